"""CPU offload: shards, gradients and the optimizer step in CPU memory, parity unchanged.

On a CPU-only machine the host-device copies are no-ops, but every offload code path runs:
shards are built on CPU, gathered through the device copy, gradients copied back."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.dist.parity import train_and_compare
from tests.models import MLP, Transformer, feature_batch, lm_loss, mse_loss, token_batch


def check_offload_parity() -> list[tuple[float, float]]:
    # torch's offload pins unconditionally, which needs an accelerator; ours pins where one
    # exists (tested below).
    offload = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return [
        train_and_compare(MLP, mse_loss, feature_batch, offload_policy=offload),
        train_and_compare(Transformer, lm_loss, token_batch, offload_policy=offload),
        train_and_compare(
            Transformer, lm_loss, token_batch, offload_policy=offload, mp_policy=bf16,
            reference_tolerance={"rtol": 2e-2, "atol": 2e-2},  # bf16 compute vs float32
        ),
    ]


def test_offload_trains_like_single_process_and_torch(ranks):
    (mlp, transformer, bf16) = ranks.run(check_offload_parity, world_size=2)[0]
    assert mlp.vs_torch == transformer.vs_torch == bf16.vs_torch == 0.0
    assert mlp.vs_reference < 1e-6 and transformer.vs_reference < 1e-6


def check_offload_keeps_shards_and_grads_on_cpu() -> None:
    model = Transformer()
    for block in model.blocks:
        fully_shard(block, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    lm_loss(model, token_batch(0, 2)).backward()
    pinned = torch.accelerator.is_available()
    for fqn, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.to_local().device.type == "cpu", fqn
        assert p.grad.to_local().device.type == "cpu", fqn
        assert p.to_local().is_pinned() == pinned, fqn
    assert dist.get_world_size() == 2


def test_offload_keeps_shards_and_grads_on_cpu(ranks):
    ranks.run(check_offload_keeps_shards_and_grads_on_cpu, world_size=2)
