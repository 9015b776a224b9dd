"""On a GPU (skipped without one): 2 and 4 ranks, each a process, share cuda:0 over gloo
with CUDA tensors (NCCL refuses two ranks on one device), so the side streams and the
async collectives run between processes. fsdp_compose.fully_shard and torch's train the
same model from the same weights on the same batches, over fp32 and bf16 compute (fp32
reduction), resharding after forward or not, with and without explicit prefetch: losses,
gradients and parameters must be bit-identical at every step, and the first step's
gradients and loss close to a single-process reference on the whole batch.

FSDP_COMPOSE_TEST_DEVICE=cpu runs the same tests on the CPU (no streams), to check the
tests themselves where there is no GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import MixedPrecisionPolicy
from tests.dist.parity import (
    Shard,
    assert_close_to,
    max_diff,
    max_diff_to,
    optimizer_step,
    per_block,
    rank_share,
    three_models,
)
from tests.models import MLP, feature_batch, mse_loss

DEVICE = torch.device(os.environ.get("FSDP_COMPOSE_TEST_DEVICE", "cuda"))

pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a GPU"
)

# cuBLAS picks its algorithms deterministically with this, read at its first use in each
# rank's process: set here, it reaches the ranks both through the environment they start
# with and when they import this module to run its functions.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# Odd sizes: dim 0 of 127, 65 and 33 pads the shards at 2 and 4 ranks, and the last
# layer's one row leaves all ranks but the first an empty shard.
DIMS = (32, 127, 65, 33, 1)
BATCH_PER_RANK, STEPS = 8, 3
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# The first step against the float32 single-process reference: summation order only in
# float32 (assert_close's defaults); in bf16, its rounding over a few layers.
BF16_VS_FLOAT32 = {"rtol": 5e-2, "atol": 5e-2}


def with_prefetch(model: nn.Module, shard: Shard) -> None:
    """A unit per layer; each prefetches the next two in forward, the two before it in
    backward, so two gathers are in flight at once."""
    per_block(model, shard)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        layer.set_modules_to_backward_prefetch(layers[max(i - 2, 0) : i][::-1])


def train_on_device(
    mp_policy: MixedPrecisionPolicy | None, reshard_after_forward: bool, prefetch: bool
) -> dict[str, float]:
    """AdamW steps of ours and torch's on this rank's share of each batch; the largest
    differences between the two (losses, gradients before each step, parameters after)."""
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)  # every rank: the one GPU
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _train(mp_policy, reshard_after_forward, prefetch)
    finally:  # the ranks' processes run other tests after this one
        torch.use_deterministic_algorithms(deterministic)


def _train(
    mp_policy: MixedPrecisionPolicy | None, reshard_after_forward: bool, prefetch: bool
) -> dict[str, float]:
    world = dist.get_world_size()
    mesh = init_device_mesh(DEVICE.type, (world,))
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}  # None: the default
    ref, ours, theirs = three_models(
        lambda: MLP(DIMS).to(DEVICE), mesh, with_prefetch if prefetch else per_block,
        reshard_after_forward=reshard_after_forward, **policy,
    )
    tolerance = {} if mp_policy is None else BF16_VS_FLOAT32
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
    diffs = dict.fromkeys(("loss", "grad", "param"), 0.0)
    for step in range(STEPS):
        batch = feature_batch(step, BATCH_PER_RANK * world, DIMS[0]).to(DEVICE)
        our_loss, their_loss = (mse_loss(m, rank_share(batch)) for m in (ours, theirs))
        our_loss.backward()
        their_loss.backward()
        if step == 0:
            check_against_reference(ref, ours, batch, our_loss, tolerance)
        diffs["loss"] = max(diffs["loss"], max_diff(our_loss.detach(), their_loss.detach()))
        diffs["grad"] = max(diffs["grad"], max_diff_to(ours, theirs, grads=True))
        optimizer_step(optims)
        diffs["param"] = max(diffs["param"], max_diff_to(ours, theirs))
    return diffs


def check_against_reference(
    ref: nn.Module, ours: nn.Module, batch: torch.Tensor, our_loss: torch.Tensor,
    tolerance: dict[str, float],
) -> None:
    """The reference on the whole batch: the mean of the ranks' losses and the averaged
    gradients must match it (a sanity check that the runs compared bit for bit are right)."""
    ref_loss = mse_loss(ref, batch)
    ref_loss.backward()
    mean_loss = our_loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= dist.get_world_size()
    torch.testing.assert_close(
        mean_loss, ref_loss.detach(), msg=lambda m: f"loss: {m}", **tolerance)
    assert_close_to(ours, ref, grads=True, where="step 0", **tolerance)


@pytest.mark.parametrize("world_size", [2, 4], ids=["2 ranks", "4 ranks"])
@pytest.mark.parametrize("mp_policy", [None, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "explicit prefetch"])
def test_ranks_sharing_a_gpu_train_like_torch(
    ranks, world_size, mp_policy, reshard_after_forward, prefetch
):
    results = ranks.run(
        train_on_device, world_size=world_size, mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward, prefetch=prefetch,
    )
    for rank, diffs in enumerate(results):
        assert diffs == {"loss": 0.0, "grad": 0.0, "param": 0.0}, (rank, diffs)
