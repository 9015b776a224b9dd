"""FSDPModule: the methods an annotated module gains, and UnshardHandle."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal, NoReturn, cast, overload

import torch
from torch import nn

from ._checks import check_reshard_after_forward
from ._codec import AllGatherCodec
from ._collectives import CustomComm
from ._hooks import UnitState, state_of
from ._meshes import resolve_reshard_after_forward, separate_group
from ._root import STATE_ATTR
from ._multi_mesh import AnyUnit
from ._unit import Unit


class FSDPModule:
    """A module annotated by `fully_shard`. Its class is a dynamic subclass of this one and of
    its original class, so `isinstance(module, OriginalClass)` still holds."""

    def __new__(cls, *args: Any, **kwargs: Any) -> FSDPModule:
        # Containers such as nn.Sequential build new instances of their own class when
        # sliced; those are plain modules of the original class, not annotated ones.
        original: type[nn.Module] = cls.__mro__[2]
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
        state: UnitState = self.__dict__[STATE_ATTR]
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
        needs), at the cost of the memory resharding frees. torch 2.15's method."""
        for state in self._states(recurse):
            for part in state.unit.parts:
                part.gatherer.keep_unsharded_storage = keep

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
        """torch 2.15's switch for finalizing backward by hand (`finalize_backward`). Here
        every backward still finishes its own reductions with the settings of its time, so
        either way the gradients are the same; `finalize_backward` reduces what those
        settings left unsharded. Call on the root, not during backward."""
        state = self._state()
        if state.initialised and not state.is_root:
            raise RuntimeError(
                f"{type(self).__name__}.set_manual_backward_finalization: unit {state.label} "
                "is not a root; call it on the root module."
            )
        if torch._C._current_graph_task_id() != -1:
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
        at once (torch 2.15's signature)."""
        state = self._state()
        if state.initialised:
            state.root.finalize_backward()
        return GradientReductionHandle() if async_op else None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward keeps unsharded gradients on each rank and accumulates
        them; the next backward with True reduces the sum. For gradient accumulation."""
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: with False, backward reduce-scatters but keeps the result for the next
        backward that all-reduces across replicas (gradient accumulation with less
        communication). No effect on a 1-D mesh."""
        for state in self._states(recurse):
            for part in state.unit.parts:
                part.reducer.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | int, recurse: bool = True
    ) -> None:
        """Whether to free the unsharded parameters after forward (gathered again in
        backward); an int keeps them sharded over groups of that many ranks instead."""
        states = self._states(recurse)
        for state in states:  # check every unit (every mesh of one) before changing any
            for part in state.unit.parts:
                check_reshard_after_forward(
                    reshard_after_forward, type(self).__name__, part.mesh.size(-1)
                )
        for state in states:
            for part in state.unit.parts:
                reshard, post_forward_mesh = resolve_reshard_after_forward(
                    reshard_after_forward, part.mesh
                )
                part.set_post_forward_mesh(post_forward_mesh)
            state.reshard_after_forward = reshard

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after backward (e.g. keep them across
        gradient-accumulation micro-batches)."""
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers this unit's parameters; False for units whose parameters
        backward never reads."""
        self._state().unshard_in_backward = unshard_in_backward

    # -- communication ----------------------------------------------------------------------

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by `factor` instead of the mesh size."""
        for part in self._state().unit.parts:
            part.reducer.set_reduction(factor, part.reducer.force_sum_reduction)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with a plain SUM on the wire and divide locally afterwards."""
        for part in self._state().unit.parts:
            part.reducer.set_reduction(part.reducer.gradient_divide_factor, enable)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start gathering `modules`' units as soon as this unit is gathered in forward, so
        their all-gathers overlap this unit's compute (e.g. the next block or two)."""
        self._state().forward_prefetch = _prefetch_states(self, modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start gathering `modules`' units as soon as this unit is gathered in backward
        (e.g. the previous block, whose backward runs next)."""
        self._state().backward_prefetch = _prefetch_states(self, modules, "backward")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of `set_gradient_divide_factor`, as in torch."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            DeprecationWarning, stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_implicit_forward_prefetch(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Prefetch in forward without explicit lists: each unit starts gathering the unit
        whose forward followed its own in the last iteration (ours; torch has no implicit
        forward prefetch). Units prefetched but not run, when the order changes, are
        resharded at the end of the forward. Explicit lists take precedence."""
        for state in self._states(recurse):
            state.implicit_forward_prefetch = enable

    def set_max_all_gathers_in_flight(self, limit: int) -> None:
        """At most `limit` (default 2) prefetched all-gathers in flight; prefetching another
        first finishes the oldest. Bounds the unsharded memory prefetch can hold. Call on
        the root (its units share the bound). Ours; torch's is fixed at 2."""
        self._set_comm_bound("max_all_gathers", limit, "set_max_all_gathers_in_flight")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """At most `max_input_buffers` (default 1) gradient reductions in flight, each
        holding its input and output buffers, while the next unit's backward computes.
        Call on the root (its units share the bound; `recurse` is accepted for torch's
        signature)."""
        self._set_comm_bound("max_reductions", max_input_buffers, "set_reduce_scatter_max_input_buffers")

    def _set_comm_bound(self, attr: str, value: int, setter: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(self).__name__}.{setter}: expected an int >= 1, got {value!r}.")
        comm = self._state().comm
        setattr(comm, attr, value)
        comm.changed_by = type(self).__name__

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce a zero gradient for parameters this rank's backward did not reach, so that
        ranks whose control flow uses different parameters of a unit (mixture of experts,
        multi-modal branches) still send the same reduce-scatter. Such parameters' `.grad`
        is then a tensor (the average, zeros where no rank used them), never None."""
        for state in self._states(recurse):
            for part in state.unit.parts:
                part.reducer.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_post_optim_event(self, event: torch.Event | None) -> None:
        """The next forward's all-gathers wait for `event` (recorded after an optimizer step
        on another stream) instead of everything before them. Waited for once, then
        dropped: set a new event every iteration. Call on the root. None (what recording an
        event on the CPU's current stream returns) waits for nothing."""
        if event is not None and not callable(getattr(event, "wait", None)):
            raise TypeError(
                f"{type(self).__name__}.set_post_optim_event: expected a torch.Event, got "
                f"{type(event).__name__}."
            )
        self._state().post_optim_event = event

    def set_custom_all_gather(self, comm: CustomComm) -> None:
        """Gather this unit's parameters with `comm(output, input, group, async_op=False)`
        (returning a Work or None) instead of all_gather_single; `comm.allocate(size, *,
        dtype, device)`, if defined, allocates the output. torch's AllGather interface."""
        _one_mesh(self, "set_custom_all_gather").custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: CustomComm) -> None:
        """Reduce this unit's gradients with `comm(output, input, group, op,
        async_op=False)` instead of reduce_scatter_single; `comm.allocate`, if defined,
        allocates input and output. torch's ReduceScatter interface."""
        _one_mesh(self, "set_custom_reduce_scatter").reducer.custom_reduce_scatter = comm

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call `hook(reduced)` on this unit's reduced gradients (the reduce-scatter output,
        or the all-reduce output with HSDP) before the final division: e.g. an all-reduce
        across another dimension. It must modify the buffer in place. fsdp_compose runs
        collectives on the current stream, so the hook runs there: `stream` must be None."""
        if stream is not None:
            raise ValueError(
                f"{type(self).__name__}.set_all_reduce_hook: fsdp_compose reduces gradients on "
                "the current stream and runs the hook there; pass stream=None."
            )
        _one_mesh(self, "set_all_reduce_hook").reducer.all_reduce_hook = hook

    def set_all_gather_codec(
        self, codec: AllGatherCodec | None, params: list[str] | None = None
    ) -> None:
        """Send this unit's parameters named in `params` (fqns under this module; default
        all) through `codec` in the all-gather, e.g. `Int8RowCodec()` for weights; None
        sends them plainly again. Ours, not torch's; see AllGatherCodec."""
        unit = self._state().unit
        by_fqn = {p.fqn: p for p in unit.params}
        names = list(by_fqn) if params is None else params
        if unknown := [n for n in names if n not in by_fqn]:
            raise ValueError(
                f"{type(self).__name__}.set_all_gather_codec: {unknown} are not parameters of "
                f"this unit; its parameters are {list(by_fqn)}."
            )
        for name in names:
            part = next(part for part in unit.parts if by_fqn[name] in part.params)
            if codec is None:
                part.codecs.pop(by_fqn[name], None)
            else:
                part.codecs[by_fqn[name]] = codec

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter on a process group of its own (over the same ranks), so gradient
        reductions in flight do not queue behind prefetched all-gathers. Collective over
        each unit's shard ranks: call it on every rank alike."""
        for state in self._states(recurse):
            for part in state.unit.parts:
                part.reducer.group = separate_group(part.group) if enable else part.group

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        _not_yet(self, "allocating communication buffers from the process group (CUDA)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        _not_yet(self, "symmetric-memory communication buffers (CUDA)")


def _prefetch_states(owner: FSDPModule, modules: list[FSDPModule], where: str) -> list[UnitState]:
    if bad := [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]:
        raise ValueError(
            f"{type(owner).__name__}.set_modules_to_{where}_prefetch: {bad} are not "
            "annotated; pass modules that fully_shard annotated."
        )
    return [m._state() for m in modules]


def _one_mesh(module: FSDPModule, setter: str) -> Unit:
    """The module's unit, when its parameters are on one mesh (torch refuses these setters
    too when shard_placement_fn put some on another)."""
    parts = module._state().unit.parts
    if len(parts) > 1:
        raise ValueError(
            f"{type(module).__name__}.{setter} is not supported with parameters on several "
            "meshes (from per-param mesh via shard_placement_fn); set it on a unit whose "
            "parameters share one mesh."
        )
    return parts[0]


def _not_yet(owner: FSDPModule, what: str) -> NoReturn:
    raise NotImplementedError(f"{type(owner).__name__}: {what} is not supported by fsdp_compose yet.")


class GradientReductionHandle:
    """Returned by `FSDPModule.finalize_backward(async_op=True)`: the reduction is done."""

    def wait(self) -> None:
        """Nothing to wait for: finalize_backward finishes before it returns."""


class UnshardHandle:
    """Returned by `FSDPModule.unshard(async_op=True)`: `wait()` finishes the unshard."""

    def __init__(self, unit: AnyUnit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_for_unshard()
