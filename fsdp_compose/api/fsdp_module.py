"""FSDPModule: the methods an annotated module gains, those that act (its `set_*` methods are
api/setters.py's), and the handles its asynchronous calls return."""

from __future__ import annotations

from typing import Any, Literal, NoReturn, cast, overload

from torch import nn

from ..schedule.iteration import UnitState, state_of
from ..unit.unit import Unit
from .setters import Setters


class FSDPModule(Setters):
    """A module annotated by `fully_shard`; its class also subclasses its original class."""

    def __new__(cls, *args: Any, **kwargs: Any) -> FSDPModule:
        # Containers such as nn.Sequential build new instances of their own class when
        # sliced; those are plain modules of the original class, not annotated ones.
        original = next(
            c for c in cls.__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
        return cast(FSDPModule, original(*args, **kwargs))

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(
            f"copy.deepcopy({type(self).__name__}): an annotated module cannot be deep-copied (its "
            "units hold process groups and shared buffers). Copy the model before fully_shard and "
            "annotate the copy, or build a new model, annotate it and "
            "load_state_dict(model.state_dict()).")

    def _state(self) -> UnitState:
        state = state_of(self)  # type: ignore[arg-type]  # a module: FSDPModule is mixed in
        assert state is not None, "fully_shard attaches a state to every FSDPModule"
        return state

    def _states(self, recurse: bool) -> list[UnitState]:
        if not recurse:
            return [self._state()]
        states = (state_of(m) for m in self.modules())  # type: ignore[attr-defined]
        return list({id(s): s for s in states if s is not None}.values())  # once each, in order

    @overload
    def unshard(self, async_op: Literal[False] = ...) -> None: ...
    @overload
    def unshard(self, async_op: Literal[True]) -> UnshardHandle: ...
    @overload
    def unshard(self, async_op: bool) -> UnshardHandle | None: ...

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now; with `async_op=True`, return a handle whose
        `wait()` finishes it (the next forward waits for it too)."""
        unit = self._state().unit
        unit.adopt_registered()  # the caller may have changed the parameters
        if unit.streams is not None:
            unit.streams.follow_compute()  # the caller may have just changed the shards
        unit.unshard(async_op=async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones."""
        self._state().unit.reshard()

    def reset_iter_state(self) -> None:
        """Forget the current iteration (e.g. after an exception): reshard every unit under the
        root and make it IDLE. Call on the root (before the first forward, on any module)."""
        state = self._state()
        if state.initialised and not state.is_root:
            raise RuntimeError(
                f"{type(self).__name__}.reset_iter_state(): unit {state.label} is not a root; "
                f"call reset_iter_state on its root, {type(state.root.state.modules[0]).__name__} "
                "(the outermost annotated module), which resets every unit under it.")
        state.reset_iter_state()

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = ...) -> None: ...
    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...
    @overload
    def finalize_backward(self, *, async_op: bool) -> GradientReductionHandle | None: ...

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """After backward passes without gradient sync, reduce the unsharded gradients with the
        current settings into the `.grad`s (no-op before the first forward, error between a
        forward and its backward); synchronous: an `async_op` handle's wait() returns at once."""
        state = self._state()
        if state.initialised:
            state.root.finalize_backward()
        return GradientReductionHandle() if async_op else None

class GradientReductionHandle:
    """Returned by `FSDPModule.finalize_backward(async_op=True)`: the reduction is done."""

    def wait(self) -> None:
        """Nothing to wait for: finalize_backward finished before it returned."""


class UnshardHandle:
    """Returned by `FSDPModule.unshard(async_op=True)`: `wait()` finishes the unshard."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_for_unshard()
