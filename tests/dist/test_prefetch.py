"""Prefetch: explicit (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch),
implicit in backward (the default) and in forward (opt-in, from the last iteration's
order), and the limiter on prefetched all-gathers in flight. Training is unchanged (parity
with single-process and torch's fully_shard), collectives are issued in torch's order,
and prefetched units that do not run are freed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_compose import fully_shard
from fsdp_compose.schedule.iteration import state_of
from tests.dist.counting import GatherOrder
from tests.dist.parity import Shard, per_block, train_and_compare
from tests.models import MLP, feature_batch, mse_loss


def with_prefetch(model: nn.Module, shard: Shard) -> None:
    """A unit per layer; each layer prefetches the next in forward, the previous in backward."""
    layers = list(model.layers)
    for layer in layers:
        shard(layer)
    shard(model)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[i - 1 : i] if i else [])


def check_prefetch_parity() -> tuple[float, float]:
    return train_and_compare(MLP, mse_loss, feature_batch, wrap=with_prefetch)


def test_prefetch_trains_like_single_process_and_torch(ranks):
    vs_reference, vs_torch = ranks.run(check_prefetch_parity, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6


def gather_order(shard: Shard, wrap=with_prefetch, reduce_scatters: bool = False) -> list[int]:
    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    wrap(model, lambda m, **kw: shard(m, mesh=mesh, **kw))
    x = feature_batch(0, 2)
    with torch.no_grad():
        model(x)  # the first forward: one-time checks
    for module in model.modules():
        if hasattr(module, "reshard"):
            module.reshard()
    with GatherOrder(reduce_scatters) as order:
        mse_loss(model, x).backward()
    return order.sizes


def check_gather_order() -> tuple[list[int], list[int]]:
    return gather_order(fully_shard), gather_order(torch_fully_shard)


@pytest.mark.torch_values_unused("compares the order of all-gathers with torch's")
def test_prefetch_issues_all_gathers_in_torchs_order(ranks):
    ours, theirs = ranks.run(check_gather_order, world_size=2)[0]
    # Layers 8->7, 7->5, 5->3, 3->1 padded for 2 ranks gather 72, 48, 24 and 8 elements.
    # Forward: each layer's gather of the next is issued before the layer computes.
    forward = ours[: ours.index(8) + 3]
    assert forward == [72, 48, "mm", 24, "mm", 8, "mm", "mm"], ours
    # Backward: the last layer again, then each layer prefetches the previous one before
    # computing its gradients.
    assert [x for x in ours[len(forward):] if x != "mm"] == [8, 24, 48, 72], ours
    # All in torch's order, except that torch gathers the last layer once more at the end
    # of backward, which nothing uses.
    assert without_last_gather_of(8, theirs) == ours, (ours, theirs)


def without_last_gather_of(size: int, order: list[int | str]) -> list[int | str]:
    last = len(order) - 1 - order[::-1].index(size)
    return order[:last] + order[last + 1 :]


def check_implicit_backward_order() -> tuple[list[int | str], list[int | str]]:
    return tuple(gather_order(shard, per_block, reduce_scatters=True)
                 for shard in (fully_shard, torch_fully_shard))


@pytest.mark.torch_values_unused("compares the order of all-gathers with torch's")
def test_backward_prefetches_implicitly_in_torchs_order(ranks):
    ours, theirs = ranks.run(check_implicit_backward_order, world_size=2)[0]
    backward = ours[ours.index(8) + 2 :]
    # Each layer's backward: its gather (prefetched by the layer after it), the next
    # layer's gather, its gradient mms, then its reduce-scatter (left running while the
    # next layer computes); the last layer's own gather opens the backward.
    assert backward == [8, 24, "mm", "mm", "RS8", 48, "mm", "mm", "RS24", 72, "mm", "mm",
                        "RS48", "mm", "RS72"], ours
    assert without_last_gather_of(8, theirs) == ours, (ours, theirs)


def check_prefetch_needs_annotated_modules() -> None:
    model = MLP()
    fully_shard(model.layers[0])
    with pytest.raises(ValueError, match=r"set_modules_to_forward_prefetch: \['Linear'\] are "
                       "not annotated"):
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])


def test_prefetch_needs_annotated_modules(ranks):
    ranks.run(check_prefetch_needs_annotated_modules, world_size=2)


class Shuffled(nn.Module):
    """Equal-width layers whose order changes between forwards: 0 1 2, then 2 0 1."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = (0, 1, 2) if self.calls % 2 == 0 else (2, 0, 1)
        self.calls += 1
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x


def with_implicit_forward_prefetch(model: nn.Module, shard: Shard) -> None:
    per_block(model, shard)
    if hasattr(model, "set_implicit_forward_prefetch"):  # ours; torch has none
        model.set_implicit_forward_prefetch()


def check_implicit_forward_prefetch_parity() -> tuple[float, float]:
    return train_and_compare(Shuffled, mse_loss, feature_batch, steps=4,
                             wrap=with_implicit_forward_prefetch)


def test_implicit_forward_prefetch_trains_like_single_process_and_torch(ranks):
    """Also while the order changes every step, so half the prefetches guess wrong."""
    vs_reference, vs_torch = ranks.run(check_implicit_forward_prefetch_parity, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6


def check_implicit_forward_prefetch_order() -> tuple[list[int | str], list[bool]]:
    torch.manual_seed(0)
    model = MLP()
    with_implicit_forward_prefetch(model, fully_shard)
    x = feature_batch(0, 2)
    mse_loss(model, x).backward()  # the first iteration records the order
    with GatherOrder() as order:
        loss = mse_loss(model, x)
    loss.backward()
    # A changed order: prefetched units that did not run are freed by the end of forward.
    shuffled = Shuffled()
    with_implicit_forward_prefetch(shuffled, fully_shard)
    freed = []
    for _ in range(3):
        y = shuffled(x)
        freed.append(not any(state_of(l).unit.is_unsharded or state_of(l).unit.gather_in_flight
                             for l in shuffled.layers))
        y.sum().backward()
    return order.sizes, freed


def test_implicit_forward_prefetch_gathers_the_next_unit_before_computing(ranks):
    order, freed = ranks.run(check_implicit_forward_prefetch_order, world_size=2)[0]
    assert order == [72, 48, "mm", 24, "mm", 8, "mm", "mm"], order
    assert freed == [True, True, True]


class InFlightAllGather:
    """An all-gather (torch's custom comm interface) that counts gathers in flight."""

    def __init__(self) -> None:
        self.in_flight = self.most = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        counted = _CountedWork(work, self)
        if not async_op:
            counted.wait()
            return None
        return counted


class _CountedWork:
    def __init__(self, work, counter) -> None:
        self.work, self.counter = work, counter

    def wait(self) -> bool:
        self.counter.in_flight -= 1
        return self.work.wait()


def prefetch_all_from_first(limit: int | None, comms: list):
    """Layer 0 prefetches every later layer in forward (more than the limit allows)."""
    def wrap(model: nn.Module, shard: Shard) -> None:
        per_block(model, shard)
        layers = list(model.layers)
        layers[0].set_modules_to_forward_prefetch(layers[1:])
        if hasattr(model, "set_max_all_gathers_in_flight"):  # ours
            if limit is not None:
                model.set_max_all_gathers_in_flight(limit)
            comm = InFlightAllGather()
            comms.append(comm)
            for module in [model, *layers]:
                module.set_custom_all_gather(comm)
    return wrap


def check_limiter(limit: int | None) -> tuple[float, float, int]:
    comms: list[InFlightAllGather] = []
    errors = train_and_compare(MLP, mse_loss, feature_batch,
                               wrap=prefetch_all_from_first(limit, comms))
    return (*errors, comms[0].most)


@pytest.mark.parametrize(("limit", "most"), [(1, 1), (None, 2), (3, 3)])
def test_limiter_bounds_all_gathers_in_flight(ranks, limit, most):
    """Layer 0 asks for 3 prefetches; at most `limit` (default 2) are ever in flight."""
    vs_reference, vs_torch, in_flight = ranks.run(check_limiter, world_size=2, limit=limit)[0]
    assert in_flight == most
    assert vs_torch == 0.0 and vs_reference < 1e-6


def check_limit_must_be_positive() -> None:
    model = fully_shard(MLP())
    with pytest.raises(
        ValueError, match=r"set_max_all_gathers_in_flight: expected an int >= 1, got 0"
    ):
        model.set_max_all_gathers_in_flight(0)
    root = fully_shard(nn.Sequential(model))
    model.set_max_all_gathers_in_flight(1)  # not the root: its root would ignore it
    with pytest.raises(
        ValueError, match=r"communication bounds were set on \['0'\].*Call the setter on the root"
    ):
        root(feature_batch(0, 2))


def test_limits_are_checked(ranks):
    ranks.run(check_limit_must_be_positive, world_size=2)
