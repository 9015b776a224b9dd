"""A long mixed run: normal steps, gradient accumulation, eval and inference forwards,
explicit unshard/reshard and failed micro-batches, in parity with a single-process replay."""

from __future__ import annotations

import contextlib
import copy
import random

import torch
import torch.distributed as dist

from fsdp_compose import fully_shard
from tests.dist.failures import Injected, raise_in_backward, raise_in_forward
from tests.dist.parity import (
    assert_close_to,
    backward,
    max_diff_to,
    optimizer_step,
    rank_share,
)
from tests.models import Transformer, lm_loss, token_batch

ACTIONS = ("step", "accumulate", "eval", "inference", "unshard", "fail")


def check_stress(steps: int) -> tuple[dict[str, int], float]:
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = Transformer(depth=3)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optims = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref)]
    choose = random.Random(0)  # the same schedule on every rank
    done = dict.fromkeys(ACTIONS, 0)
    batch = 0

    def micro_batch(sync: bool) -> None:
        nonlocal batch
        tokens = token_batch(batch, 2 * world)
        batch += 1
        model.set_requires_gradient_sync(sync)
        backward((ref, model), tokens, lm_loss)

    worst = 0.0
    for _ in range(steps):
        action = choose.choice(ACTIONS)
        done[action] += 1
        if action == "step":
            micro_batch(sync=True)
            optimizer_step(optims)
        elif action == "accumulate":
            for _ in range(choose.randint(1, 3)):
                micro_batch(sync=False)
            micro_batch(sync=True)
            optimizer_step(optims)
        elif action in ("eval", "inference"):
            tokens = token_batch(10_000 + batch, 2 * world)[:, :-1]
            for m in (model, ref):
                m.eval()
            with torch.no_grad() if action == "eval" else torch.inference_mode():
                ours, theirs = model(rank_share(tokens)), rank_share(ref(tokens))
            torch.testing.assert_close(ours, theirs)
            for m in (model, ref):
                m.train()
        elif action == "unshard":
            model.unshard()  # explicitly, ahead of a step; reshard afterwards
            micro_batch(sync=True)
            model.reshard()
            optimizer_step(optims)
        else:  # a micro-batch whose forward or backward raises, then a normal step
            (raise_in_forward if choose.random() < 0.5 else raise_in_backward)(model)
            with contextlib.suppress(Injected):
                lm_loss(model, rank_share(token_batch(batch, 2 * world))).backward()
            micro_batch(sync=True)
            optimizer_step(optims)
        worst = max(worst, max_diff_to(model, ref))
    assert_close_to(model, ref)
    return done, worst


def test_stress_mixed_run_matches_single_process(ranks):
    done, worst = ranks.run(check_stress, world_size=2, steps=150)[0]
    assert all(count > 10 for count in done.values()), done  # every kind of step ran
    assert worst < 1e-4, worst
