"""Bytes on the wire: each strategy moves exactly its analytic volume per training step.

A ring all-gather or reduce-scatter of a B-byte buffer sends B·(g−1)/g per rank over a
group of g; an all-reduce twice that. So full sharding's floor of 3·Ψ·(W−1)/W elements per
step holds exactly when the buffers sum to Ψ per pass: the tests check the buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import MixedPrecisionPolicy, fully_shard, replicate
from tests.dist.counting import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    CollectiveCounter,
    first_forward,
)
from tests.models import MLP, feature_batch, mse_loss

# Every dim 0 divides 2 and 4, so no padding: the buffers are exactly the parameters.
DIMS = (8, 8, 8, 4)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def one_step_bytes(shard) -> tuple[int, dict[str, int]]:
    torch.manual_seed(0)
    model = MLP(DIMS)
    numel = sum(p.numel() for p in model.parameters())
    for layer in model.layers:
        shard(layer)
    shard(model)
    x = feature_batch(0, 4)
    first_forward(model, x)
    with CollectiveCounter() as comms:
        mse_loss(model, x).backward()
    return numel, dict(comms.bytes)


def check_bytes() -> dict[str, tuple[int, dict[str, int]]]:
    world = dist.get_world_size()
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return {
        "full": one_step_bytes(lambda m: fully_shard(m, mp_policy=BF16)),
        "hsdp": one_step_bytes(lambda m: fully_shard(m, mesh=hsdp, mp_policy=BF16)),
        "replicate": one_step_bytes(lambda m: replicate(m, mp_policy=BF16)),
    }


def test_each_strategy_moves_its_analytic_volume(ranks):
    results = ranks.run(check_bytes, world_size=4)[0]
    psi, full = results["full"]
    # Full sharding: forward and backward gathers of Ψ bf16 elements, one float32
    # reduce-scatter of Ψ. (The MLP root holds no parameters, so every unit reshards.)
    assert full == {ALL_GATHER: 2 * psi * 2, REDUCE_SCATTER: psi * 4}
    # HSDP with 2 replicas of 2 shards: the same gathers and reduce-scatter inside the
    # shard group, then an all-reduce of this rank's Ψ/2 shard across replicas.
    _, hsdp = results["hsdp"]
    assert hsdp == {ALL_GATHER: 2 * psi * 2, REDUCE_SCATTER: psi * 4, ALL_REDUCE: psi // 2 * 4}
    # Replicate: no gathers, an all-reduce of all Ψ gradients.
    _, replicated = results["replicate"]
    assert replicated == {ALL_REDUCE: psi * 4}
