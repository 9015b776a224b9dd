"""FSDPModule: the methods an annotated module gains (its communication setters are
api/comm_setters.py's), and the handles its asynchronous calls return."""

from __future__ import annotations

from typing import Any, Literal, NoReturn, cast, overload

from torch import nn

from ..comm.meshes import resolve_reshard_after_forward
from ..schedule.iteration import UnitState
from ..schedule.phase import in_backward
from ..schedule.state import state_of
from ..unit.unit import Unit
from .checks import check_reshard_after_forward, refuse_post_forward_tensor_parallel
from .comm_setters import CommSetters


class FSDPModule(CommSetters):
    """A module annotated by `fully_shard`: its class subclasses this one and its original
    class, so `isinstance(module, OriginalClass)` still holds."""

    def __new__(cls, *args: Any, **kwargs: Any) -> FSDPModule:
        # Containers such as nn.Sequential build new instances of their own class when
        # sliced; those are plain modules of the original class, not annotated ones.
        original: type[nn.Module] = next(
            c for c in cls.__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule)
        )
        module = original.__new__(original)
        original.__init__(module, *args, **kwargs)
        return cast(FSDPModule, module)

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(
            f"copy.deepcopy({type(self).__name__}): an annotated module cannot be deep-copied (its units "
            "hold process groups and shared buffers). Copy the model before fully_shard and annotate the "
            "copy, or build a new model, annotate it and load_state_dict(model.state_dict())."
        )

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

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded storage allocated on reshard, so data pointers stay fixed (as CUDA
        graphs need) at the cost of that memory. Newer torch's method."""
        for state in self._states(recurse):
            state.settings.keep_unsharded_storage = keep

    def reset_iter_state(self) -> None:
        """Forget the current iteration (e.g. after an exception): reshard every unit under the
        root and make it IDLE. Call on the root (before the first forward, on any module)."""
        state = self._state()
        if state.initialised and not state.is_root:
            raise RuntimeError(
                f"{type(self).__name__}.reset_iter_state(): unit {state.label} is not a root; "
                f"call reset_iter_state on its root, {type(state.root.state.modules[0]).__name__} "
                "(the outermost annotated module), which resets every unit under it."
            )
        state.reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API; a no-op: every backward here finishes its reductions."""

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Newer torch's; a no-op here (every backward finishes its reductions), checked as
        torch does: on the root, not during backward."""
        state = self._state()
        if state.initialised and not state.is_root:
            raise RuntimeError(
                f"{type(self).__name__}.set_manual_backward_finalization: unit {state.label} "
                "is not a root; call it on the root module."
            )
        if in_backward():
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = ...) -> None: ...
    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...
    @overload
    def finalize_backward(self, *, async_op: bool) -> GradientReductionHandle | None: ...

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """After a step's backward passes, reduce the gradients held unsharded (no gradient sync)
        with the current settings and commit them to the `.grad`s; a no-op before the first
        forward, an error between a forward and its backward (synchronous: an `async_op` handle's
        wait() returns at once)."""
        state = self._state()
        if state.initialised:
            state.root.finalize_backward()
        return GradientReductionHandle() if async_op else None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates unsharded gradients; the next with True reduces."""
        for state in self._states(recurse):
            state.settings.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with False, backward reduce-scatters but defers the all-reduce across replicas
        to the next backward with True."""
        for state in self._states(recurse):
            state.settings.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Free the unsharded parameters after forward; an int k keeps them sharded over
        groups of k ranks instead. As fully_shard's argument."""
        states = self._states(recurse)
        where = f"{type(self).__name__}.set_reshard_after_forward"
        for state in states:  # check every unit (every mesh of one) before changing any
            for part in state.unit.parts:
                check_reshard_after_forward(reshard_after_forward, where, part.mesh.shard_size)
                smaller = reshard_after_forward not in (True, False, 1, part.mesh.shard_size)
                if smaller and (tp := [p.fqn for p in part.params if p.is_tensor_parallel]):
                    refuse_post_forward_tensor_parallel(where, tp[0])
        for state in states:
            parts = state.unit.parts
            resolved = [resolve_reshard_after_forward(reshard_after_forward, p.device_mesh) for p in parts]
            state.unit.set_post_forward_meshes([mesh for _, mesh in resolved])
            state.settings.reshard_after_forward = resolved[-1][0]

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free the unsharded parameters after backward (False: keep them for the next)."""
        for state in self._states(recurse):
            state.settings.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers this unit (False when backward never reads it)."""
        self._state().settings.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start gathering `modules` once this unit is gathered in forward (the next blocks)."""
        where = f"{type(self).__name__}.set_modules_to_forward_prefetch"
        self._state().prefetch.forward = annotated_states(modules, where)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start gathering `modules` once this unit is gathered in backward (the previous block)."""
        where = f"{type(self).__name__}.set_modules_to_backward_prefetch"
        self._state().prefetch.backward = annotated_states(modules, where)

    def set_implicit_forward_prefetch(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Ours: each unit prefetches the unit whose forward followed its own last iteration
        (resharded after forward if not run); explicit lists take precedence."""
        for state in self._states(recurse):
            state.prefetch.implicit_forward = enable


def annotated_states(modules: list[FSDPModule], where: str) -> list[UnitState]:
    if bad := [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]:
        raise ValueError(f"{where}: {bad} are not annotated; pass modules that fully_shard annotated.")
    return [m._state() for m in modules]


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
