"""Failed steps recover without a call: an exception in forward or backward leaves every unit
resharded, drops the failed backward's gradients, keeps earlier micro-batches' gradients,
and the next steps train exactly as if the failure had not happened."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compose import fully_shard
from tests.dist.failures import Injected, raise_in_backward, raise_in_forward
from tests.dist.parity import (
    assert_close_to,
    backward,
    make_mesh,
    optimizer_step,
    per_block,
    rank_share,
)
from tests.models import Transformer, lm_loss, token_batch


def check_failed_steps_recover(mesh_shape: tuple[int, ...]) -> None:
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = Transformer(depth=3)
    model = copy.deepcopy(ref)
    mesh = make_mesh(mesh_shape)
    per_block(model, lambda m, **kw: fully_shard(m, mesh=mesh))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def micro_batch(step: int, sync: bool, fail: str | None = None) -> None:
        """One micro-batch on ours (maybe failing) and, unless failing, on the reference."""
        tokens = token_batch(step, 2 * world)
        model.set_requires_gradient_sync(sync)
        if not fail:
            backward((ref, model), tokens, lm_loss)
            return
        (raise_in_forward if fail == "forward" else raise_in_backward)(model)
        with pytest.raises(Injected):
            lm_loss(model, rank_share(tokens)).backward()
        if fail == "forward":  # resharded at once; after a backward, at the next forward
            assert all(isinstance(p, DTensor) for p in model.parameters())

    def step_and_compare() -> None:
        optimizer_step((optim, ref_optim))
        assert_close_to(model, ref)

    # (failures at these micro-batches, sync flags): every pattern ends in a synced step.
    schedules = [
        [(None, True)],
        [("forward", True), (None, True)],
        [("backward", True), (None, True)],
        [(None, False), ("forward", False), (None, True)],
        [(None, False), ("backward", False), (None, False), (None, True)],
        [(None, False), ("backward", True), (None, True)],  # sync backward fails mid-way
    ]
    step = 0
    for schedule in schedules:
        for fail, sync in schedule:
            micro_batch(step, sync, fail)
            step += 0 if fail else 1
        step_and_compare()


def test_failed_steps_recover_full_sharding(ranks):
    ranks.run(check_failed_steps_recover, world_size=2, mesh_shape=(2,))


def test_failed_steps_recover_hsdp(ranks):
    ranks.run(check_failed_steps_recover, world_size=4, mesh_shape=(2, 2))


def check_reset_iter_state_is_safe_any_time() -> None:
    torch.manual_seed(0)
    ref = Transformer()
    model = copy.deepcopy(ref)
    per_block(model, fully_shard)
    model.reset_iter_state()  # before the first forward
    model.unshard()
    model.reset_iter_state()  # with the root unsharded by hand
    assert all(isinstance(p, DTensor) for p in model.parameters())
    loss = lm_loss(model, token_batch(0, 2))  # forward done, backward not started
    model.reset_iter_state()
    del loss
    backward((ref, model), token_batch(1, 2 * dist.get_world_size()), lm_loss)
    assert_close_to(model, ref, grads=True)


def test_reset_iter_state_is_safe_any_time(ranks):
    ranks.run(check_reset_iter_state_is_safe_any_time, world_size=2)


class Flaky(nn.Linear):
    """Raises in forward while `fail` is set."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise Injected("flaky")
        return super().forward(x)


class WithFallback(nn.Module):
    """Runs `flaky` and, where it raises, `fallback` instead: an exception that the
    enclosing forward catches."""

    def __init__(self) -> None:
        super().__init__()
        self.flaky, self.fallback, self.head = Flaky(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.flaky_was_resharded: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            x = self.flaky(x)
        except Injected:
            self.flaky_was_resharded.append(isinstance(self.flaky.weight, DTensor))
            x = self.fallback(x)
        return self.head(x)


def check_caught_unit_exception() -> None:
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = WithFallback()
    model = copy.deepcopy(ref)
    for unit in (model.flaky, model.fallback, model):
        fully_shard(unit)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, fail in enumerate([False, True, False, True, True, False]):
        model.flaky.fail = ref.flaky.fail = fail
        x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(step))
        backward((ref, model), x, lambda m, batch: m(batch).square().mean())
        optimizer_step((optim, ref_optim))
    assert model.flaky_was_resharded == [True, True, True]  # at once, inside the forward
    assert_close_to(model, ref)


def test_a_unit_that_raised_inside_a_forward_that_caught_it_is_resharded_and_trains(ranks):
    ranks.run(check_caught_unit_exception, world_size=2)
