"""fp16 training with torch.amp.GradScaler on sharded gradients.

Each rank holds only a shard of every gradient, so an overflow can show in one rank's
shards alone. The scaler's unscale runs on the DTensor gradients, whose found-inf flag is
reduced over the mesh: every rank skips, or steps, together and keeps the same scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from tests.dist.parity import rank_share
from tests.models import MLP, feature_batch, mse_loss

FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


def scaled_steps(steps: int, overflow_on_rank: int | None) -> list[tuple[bool, float]]:
    """Scaled SGD steps in fp16; on the first, `overflow_on_rank` alone finds an inf in
    its first gradient shard. Per step: (this rank's parameters changed, scale after)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer, mp_policy=FP16)
    fully_shard(model, mp_policy=FP16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    history = []
    for step in range(steps):
        before = [p.detach().to_local().clone() for p in model.parameters()]
        x = rank_share(feature_batch(step, 2 * world))
        scaler.scale(mse_loss(model, x)).backward()
        if step == 0 and rank == overflow_on_rank:
            grad = next(p.grad.to_local() for p in model.parameters() if p.grad.to_local().numel())
            grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        history.append((any(not torch.equal(b, p.to_local())
                            for b, p in zip(before, model.parameters())), scaler.get_scale()))
    return history


def test_overflow_on_one_rank_skips_the_step_on_every_rank(ranks):
    for history in ranks.run(scaled_steps, world_size=2, steps=2, overflow_on_rank=1):
        # Step 0: nobody steps, the scale halves; step 1: everybody steps, it grows back.
        assert history == [(False, 512.0), (True, 1024.0)]


def test_without_overflow_every_rank_steps_and_the_scale_grows(ranks):
    for history in ranks.run(scaled_steps, world_size=4, steps=3, overflow_on_rank=None):
        assert history == [(True, 2048.0), (True, 4096.0), (True, 8192.0)]
