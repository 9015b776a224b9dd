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
    """A module annotated by `fully_shard`. Its class is a dynamic subclass of this one and of
    its original class, so `isinstance(module, OriginalClass)` still holds. Its setters of
    how the units communicate are in api/comm_setters.py."""

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
        name = type(self).__name__
        raise TypeError(
            f"copy.deepcopy({name}): an annotated module cannot be deep-copied (its units hold "
            "process groups and shared buffers). Copy the model before fully_shard and annotate "
            "the copy, or build a new model, annotate it and load_state_dict(model.state_dict())."
        )

    def _state(self) -> UnitState:
        state = state_of(self)  # type: ignore[arg-type]  # a module: FSDPModule is mixed in
        assert state is not None, "fully_shard attaches a state to every FSDPModule"
        return state

    def _states(self, recurse: bool) -> list[UnitState]:
        if not recurse:
            return [self._state()]
        states: list[UnitState] = []
        for module in self.modules():  # type: ignore[attr-defined]
            state = state_of(module)
            if state is not None and not any(state is s for s in states):
                states.append(state)
        return states

    # -- state ------------------------------------------------------------------------------

    @overload
    def unshard(self, async_op: Literal[False] = ...) -> None: ...
    @overload
    def unshard(self, async_op: Literal[True]) -> UnshardHandle: ...
    @overload
    def unshard(self, async_op: bool) -> UnshardHandle | None: ...

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now. With `async_op=True`, return a handle whose
        `wait()` finishes the unshard; the next forward waits for it too."""
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
        """Keep the unsharded parameters' storage allocated when resharding (its data
        pointers then stay the same across reshard and unshard, as CUDA graph capture
        needs), at the cost of the memory resharding frees. Newer torch's method."""
        for state in self._states(recurse):
            state.settings.keep_unsharded_storage = keep

    def reset_iter_state(self) -> None:
        """Forget the current iteration (e.g. after an exception): every unit under the root
        is resharded and IDLE. Safe to call at any time, on the root (before the first
        forward, on any annotated module: none is a root yet)."""
        state = self._state()
        if state.initialised and not state.is_root:
            raise RuntimeError(
                f"{type(self).__name__}.reset_iter_state(): unit {state.label} is not a root; "
                f"call reset_iter_state on its root, {type(state.root.state.modules[0]).__name__} "
                "(the outermost annotated module), which resets every unit under it."
            )
        state.reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for code written for torch's fully_shard, which waits for pending
        gradient reductions only after the last backward. Here every backward finishes its
        reductions before it returns, so each one is complete and there is nothing to set."""

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Newer torch's switch for finalizing backward by hand (`finalize_backward`). Here
        every backward still finishes its own reductions with the settings of its time, so
        either way the gradients are the same; `finalize_backward` reduces what those
        settings left unsharded. Call on the root, not during backward."""
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
        """After the backward passes of one step: reduce the gradients held unsharded (by
        backwards without gradient sync) with the current settings, reshard, and commit
        them to the sharded `.grad`s. A no-op before the first forward. Not between a
        forward and its backward. Synchronous; with `async_op` the handle's wait() returns
        at once (newer torch's signature)."""
        state = self._state()
        if state.initialised:
            state.root.finalize_backward()
        return GradientReductionHandle() if async_op else None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward keeps unsharded gradients on each rank and accumulates
        them; the next backward with True reduces the sum. For gradient accumulation."""
        for state in self._states(recurse):
            state.settings.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: with False, backward reduce-scatters but keeps the result for the next
        backward that all-reduces across replicas (gradient accumulation with less
        communication). No effect on a 1-D mesh."""
        for state in self._states(recurse):
            state.settings.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | int, recurse: bool = True
    ) -> None:
        """Whether to free the unsharded parameters after forward (gathered again in
        backward); an int keeps them sharded over groups of that many ranks instead."""
        states = self._states(recurse)
        for state in states:  # check every unit (every mesh of one) before changing any
            for part in state.unit.parts:
                where = f"{type(self).__name__}.set_reshard_after_forward"
                check_reshard_after_forward(reshard_after_forward, where, part.mesh.shard_size)
                smaller = reshard_after_forward not in (True, False, 1, part.mesh.shard_size)
                if smaller and (tp := [p.fqn for p in part.params if p.is_tensor_parallel]):
                    refuse_post_forward_tensor_parallel(where, tp[0])
        for state in states:
            resolved = [
                resolve_reshard_after_forward(reshard_after_forward, part.device_mesh)
                for part in state.unit.parts
            ]
            state.unit.set_post_forward_meshes([mesh for _, mesh in resolved])
            state.settings.reshard_after_forward = resolved[-1][0]

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after backward (e.g. keep them across
        gradient-accumulation micro-batches)."""
        for state in self._states(recurse):
            state.settings.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers this unit's parameters; False for units whose parameters
        backward never reads."""
        self._state().settings.unshard_in_backward = unshard_in_backward

    # -- prefetch ---------------------------------------------------------------------------

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start gathering `modules`' units as soon as this unit is gathered in forward, so
        their all-gathers overlap this unit's compute (e.g. the next block or two)."""
        self._state().prefetch.forward = _prefetch_states(self, modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start gathering `modules`' units as soon as this unit is gathered in backward
        (e.g. the previous block, whose backward runs next)."""
        self._state().prefetch.backward = _prefetch_states(self, modules, "backward")

    def set_implicit_forward_prefetch(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Prefetch in forward without explicit lists: each unit starts gathering the unit
        whose forward followed its own in the last iteration (ours; torch has no implicit
        forward prefetch). Units prefetched but not run, when the order changes, are
        resharded at the end of the forward. Explicit lists take precedence."""
        for state in self._states(recurse):
            state.prefetch.implicit_forward = enable


def _prefetch_states(owner: FSDPModule, modules: list[FSDPModule], where: str) -> list[UnitState]:
    if bad := [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]:
        raise ValueError(
            f"{type(owner).__name__}.set_modules_to_{where}_prefetch: {bad} are not "
            "annotated; pass modules that fully_shard annotated."
        )
    return [m._state() for m in modules]


class GradientReductionHandle:
    """Returned by `FSDPModule.finalize_backward(async_op=True)`: the reduction is done."""

    def wait(self) -> None:
        """Nothing to wait for: finalize_backward finishes before it returns."""


class UnshardHandle:
    """Returned by `FSDPModule.unshard(async_op=True)`: `wait()` finishes the unshard."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_for_unshard()
