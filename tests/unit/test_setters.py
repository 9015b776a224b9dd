"""Every FSDPModule setter writes one field of UnitSettings, and only that one: the table
below lists each `set_*` method with its field (a new setter fails the first test until it is
listed here), and each call is checked against a snapshot of every unit's settings and of the
state objects around them. Torch's setters that do nothing here or refuse change nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compose import FSDPModule, Int8RowCodec, fully_shard
from fsdp_compose.schedule.iteration import state_of
from tests.models import MLP

Call = Callable[[Any], None]


class Event:
    def wait(self) -> None:
        pass


def comm(*args: Any, **kwargs: Any) -> None:
    pass


# setter: (a call on the root of an MLP annotated per block, the field it writes, whether
# it writes it on every unit (recurse) or on the one called alone: the root's, but the
# codec's, on the first block's: the root has no parameters of its own)
WRITES: dict[str, tuple[Call, str, bool]] = {
    "set_reshard_after_forward": (
        lambda m: m.set_reshard_after_forward(False), "reshard_after_forward", True),
    "set_reshard_after_backward": (
        lambda m: m.set_reshard_after_backward(False), "reshard_after_backward", True),
    "set_unshard_in_backward": (
        lambda m: m.set_unshard_in_backward(False), "unshard_in_backward", False),
    "set_keep_unsharded_storage": (
        lambda m: m.set_keep_unsharded_storage(True), "keep_unsharded_storage", True),
    "set_modules_to_forward_prefetch": (
        lambda m: m.set_modules_to_forward_prefetch([m.layers[0]]), "forward_prefetch", False),
    "set_modules_to_backward_prefetch": (
        lambda m: m.set_modules_to_backward_prefetch([m.layers[1]]), "backward_prefetch", False),
    "set_implicit_forward_prefetch": (
        lambda m: m.set_implicit_forward_prefetch(), "implicit_forward_prefetch", True),
    "set_max_all_gathers_in_flight": (
        lambda m: m.set_max_all_gathers_in_flight(1), "max_all_gathers_in_flight", False),
    "set_post_optim_event": (lambda m: m.set_post_optim_event(Event()), "post_optim_event", False),
    "set_requires_gradient_sync": (
        lambda m: m.set_requires_gradient_sync(False), "requires_gradient_sync", True),
    "set_requires_all_reduce": (
        lambda m: m.set_requires_all_reduce(False), "requires_all_reduce", True),
    "set_reduce_scatter_unused_params": (
        lambda m: m.set_reduce_scatter_unused_params(True), "reduce_scatter_unused_params", True),
    "set_gradient_divide_factor": (
        lambda m: m.set_gradient_divide_factor(3.0), "gradient_divide_factor", False),
    "set_reduce_scatter_divide_factor": (
        lambda m: m.set_reduce_scatter_divide_factor(3.0), "gradient_divide_factor", False),
    "set_force_sum_reduction_for_comms": (
        lambda m: m.set_force_sum_reduction_for_comms(True), "force_sum_reduction", False),
    "set_reduce_scatter_max_input_buffers": (
        lambda m: m.set_reduce_scatter_max_input_buffers(2), "reduce_scatter_max_input_buffers",
        False),
    "set_all_reduce_hook": (lambda m: m.set_all_reduce_hook(comm), "all_reduce_hook", False),
    "set_separate_reduce_scatter_group": (
        lambda m: m.set_separate_reduce_scatter_group(), "separate_reduce_scatter_group", True),
    "set_custom_all_gather": (lambda m: m.set_custom_all_gather(comm), "custom_all_gather", False),
    "set_custom_reduce_scatter": (
        lambda m: m.set_custom_reduce_scatter(comm), "custom_reduce_scatter", False),
    "set_all_gather_codec": (
        lambda m: m.layers[0].set_all_gather_codec(Int8RowCodec()), "codecs", False),
}
NO_OPS: dict[str, Call] = {  # torch's, accepted: every backward here finishes its reductions
    "set_is_last_backward": lambda m: m.set_is_last_backward(False),
    "set_manual_backward_finalization": lambda m: m.set_manual_backward_finalization(True),
}
REFUSED: dict[str, Call] = {  # torch's CUDA buffer options: NotImplementedError
    "set_allocate_memory_from_process_group_for_comm":
        lambda m: m.set_allocate_memory_from_process_group_for_comm(True),
    "set_symm_mem_for_comm": lambda m: m.set_symm_mem_for_comm(),
}


@pytest.fixture
def model() -> Iterator[nn.Module]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = MLP(dims=(8, 16, 16, 8))
        for layer in model.layers:
            fully_shard(layer)
        yield fully_shard(model)
    finally:
        dist.destroy_process_group()


def snapshot(model: nn.Module) -> dict[tuple[str, str], Any]:
    """Every unit's settings by field, and the attributes of the objects that once held
    settings (the unit state, its prefetch and comm context): (unit, name) -> value."""
    taken: dict[tuple[str, str], Any] = {}
    for i, unit in enumerate(dict.fromkeys(s for m in model.modules() if (s := state_of(m)))):
        for field in dataclasses.fields(unit.settings):
            value = getattr(unit.settings, field.name)
            copied = value.copy() if isinstance(value, (list, dict)) else value
            taken[f"unit {i}", field.name] = copied
        for owner in (unit, unit.prefetch, unit.comm):
            for name, value in vars(owner).items():
                taken[f"unit {i}", f"{type(owner).__name__}.{name}"] = Same(value)
    return taken


@dataclasses.dataclass(eq=False)
class Same:
    """Equal to a Same of the same object: an attribute rebound shows, a mutated one does not
    (the settings snapshot sees those)."""

    value: Any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.value is self.value


def changes(model: nn.Module, call: Call) -> set[tuple[str, str]]:
    before = snapshot(model)
    call(model)
    after = snapshot(model)
    return {key for key in before if before[key] != after[key]}


def test_every_setter_is_listed_once() -> None:
    setters = {name for name in dir(FSDPModule) if name.startswith("set_")}
    assert setters == WRITES.keys() | NO_OPS.keys() | REFUSED.keys()
    assert not WRITES.keys() & (NO_OPS.keys() | REFUSED.keys())
    assert not NO_OPS.keys() & REFUSED.keys()


@pytest.mark.filterwarnings("ignore:set_reduce_scatter_divide_factor is deprecated")
@pytest.mark.parametrize("setter", WRITES)
def test_each_setter_writes_its_one_field_and_nothing_else(model: nn.Module, setter: str) -> None:
    call, field, recurse = WRITES[setter]
    units = [state_of(model), *(state_of(layer) for layer in model.layers)]
    called = units.index(state_of(model.layers[0] if setter == "set_all_gather_codec" else model))
    written = range(len(units)) if recurse else [called]
    assert changes(model, call) == {(f"unit {i}", field) for i in written}


@pytest.mark.parametrize("setter", NO_OPS)
def test_torch_setters_that_do_nothing_here_change_nothing(model: nn.Module, setter: str) -> None:
    assert changes(model, NO_OPS[setter]) == set()


@pytest.mark.parametrize("setter", REFUSED)
def test_refused_setters_raise_and_change_nothing(model: nn.Module, setter: str) -> None:
    before = snapshot(model)
    with pytest.raises(NotImplementedError, match="not supported by fsdp_compose yet"):
        REFUSED[setter](model)
    assert snapshot(model) == before
