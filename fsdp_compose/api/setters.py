"""FSDPModule's setters, every `set_*` method: each writes one field of UnitSettings
(unit/settings.py), on this unit, on every unit under it (`recurse`), or on its root; a
setting that decides something once (a mesh, a group, a layout) has the Unit derive it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from ..comm.collectives import CustomComm
from ..comm.meshes import resolve_reshard_after_forward
from ..param.codec import AllGatherCodec
from ..schedule.iteration import UnitState
from ..schedule.phase import in_backward
from .checks import check_reshard_after_forward, refuse_post_forward_tensor_parallel


class Setters:
    """A mixin of FSDPModule (api/fsdp_module.py): torch's setters, and ours."""

    # FSDPModule's: this module's unit state, and with recurse those of every unit under it.
    _state: Callable[[], UnitState]
    _states: Callable[[bool], list[UnitState]]

    def _write(self, field: str, value: Any, recurse: bool = False) -> None:
        for state in self._states(recurse):
            setattr(state.settings, field, value)

    def _write_on_root(self, field: str, value: Any) -> None:
        """The root's fields (one for all its units); set before the first forward, on the
        unit it was called on, whose root takes it then (schedule/hooks.py)."""
        state = self._state()
        setattr((state.root.state if state.initialised else state).settings, field, value)

    def _where(self, setter: str) -> str:
        return f"{type(self).__name__}.{setter}"

    # -- when to gather and free ------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool | int,
                                  recurse: bool = True) -> None:
        """As fully_shard's: free unsharded parameters after forward (int k: over k ranks)."""
        states, where = self._states(recurse), self._where("set_reshard_after_forward")
        value = reshard_after_forward
        for state in states:  # check every unit (every mesh of one) before changing any
            for part in state.unit.parts:
                check_reshard_after_forward(value, where, part.mesh.shard_size)
                smaller = value not in (True, False, 1, part.mesh.shard_size)
                if smaller and (tp := [p.fqn for p in part.params if p.is_tensor_parallel]):
                    refuse_post_forward_tensor_parallel(where, tp[0])
        for state in states:
            resolved = [resolve_reshard_after_forward(value, p.device_mesh)
                        for p in state.unit.parts]
            state.unit.set_post_forward_meshes([mesh for _, mesh in resolved])
            state.settings.reshard_after_forward = resolved[-1][0]

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Free the unsharded parameters after backward (False: keep them for the next)."""
        self._write("reshard_after_backward", reshard_after_backward, recurse)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers this unit (False when backward never reads it)."""
        self._write("unshard_in_backward", unshard_in_backward)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Newer torch's: keep unsharded storage on reshard (fixed pointers for CUDA graphs)."""
        self._write("keep_unsharded_storage", keep, recurse)

    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None:
        """Start gathering `modules` once this unit is gathered in forward (the next blocks)."""
        where = self._where("set_modules_to_forward_prefetch")
        self._write("forward_prefetch", annotated_states(modules, where))

    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None:
        """Start gathering `modules` once this unit is gathered in backward (the previous one)."""
        where = self._where("set_modules_to_backward_prefetch")
        self._write("backward_prefetch", annotated_states(modules, where))

    def set_implicit_forward_prefetch(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Ours: each unit prefetches the unit whose forward followed its own last iteration
        (resharded after forward if not run); explicit lists take precedence."""
        self._write("implicit_forward_prefetch", enable, recurse)

    def set_max_all_gathers_in_flight(self, limit: int) -> None:
        """Ours: at most `limit` (default 2, torch's fixed value) prefetched all-gathers in
        flight, bounding prefetch's memory. Call on the root (its units share the bound)."""
        limit = _at_least_one(self, limit, "set_max_all_gathers_in_flight")
        self._write_on_root("max_all_gathers_in_flight", limit)

    def set_post_optim_event(self, event: torch.Event | None) -> None:
        """The root's next forward all-gathers wait for `event` (an optimizer step on another
        stream) once: set one every iteration. None (CPU's recorded event) waits for nothing."""
        if event is not None and not callable(getattr(event, "wait", None)):
            raise TypeError(f"{self._where('set_post_optim_event')}: expected a torch.Event, "
                            f"got {type(event).__name__}.")
        self._write_on_root("post_optim_event", event)

    # -- the reduction ----------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """With False, backward accumulates unsharded gradients; the next with True reduces."""
        self._write("requires_gradient_sync", requires_gradient_sync, recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with False, backward defers the all-reduce over replicas to the next with True."""
        self._write("requires_all_reduce", requires_all_reduce, recurse)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Reduce zeros for parameters this rank's backward did not reach (mixture of experts),
        so all ranks send the same reduce-scatter; such a `.grad` is a tensor, never None."""
        self._write("reduce_scatter_unused_params", reduce_scatter_unused_params, recurse)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by `factor` instead of the mesh size."""
        self._write("gradient_divide_factor", factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of `set_gradient_divide_factor`, as in torch."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use "
                      "set_gradient_divide_factor", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with a plain SUM on the wire and divide locally afterwards."""
        self._write("force_sum_reduction", enable)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """At most `max_input_buffers` (default 1) gradient reductions in flight. Call on the
        root (its units share the bound; `recurse` is only torch's signature)."""
        limit = _at_least_one(self, max_input_buffers, "set_reduce_scatter_max_input_buffers")
        self._write_on_root("reduce_scatter_max_input_buffers", limit)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Any = None) -> None:
        """Call `hook(reduced)` on this unit's reduced gradients before the final division, to
        modify them in place (e.g. all-reduce across another dim), once per mesh of its
        parameters (torch refuses several); on the reduce-scatter stream or `stream`, as torch's."""
        if stream is not None and not callable(getattr(stream, "wait_stream", None)):
            raise TypeError(f"{self._where('set_all_reduce_hook')}: stream must be a torch.Stream "
                            f"or None, got {type(stream).__name__}.")
        self._write("all_reduce_hook", (hook, stream))

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Ours: reduce-scatter on a process group of its own, so reductions do not queue behind
        prefetched all-gathers. Collective: call it on every rank alike."""
        for state in self._states(recurse):
            state.unit.set_separate_reduce_scatter_group(enable)

    # -- what the collectives are -----------------------------------------------------------

    def set_custom_all_gather(self, comm: CustomComm) -> None:
        """Gather this unit with `comm(output, input, group, async_op=False)` -> Work | None;
        `comm.allocate(size, *, dtype, device)`, if any, allocates the output (torch's API)."""
        self._write("custom_all_gather", comm)
        self._state().unit.shards_replaced()  # at one rank too, it gathers through `comm`

    def set_custom_reduce_scatter(self, comm: CustomComm) -> None:
        """Reduce this unit's gradients with `comm(output, input, group, op, async_op=False)`;
        `comm.allocate`, if any, allocates input and output (torch's API)."""
        self._write("custom_reduce_scatter", comm)

    def set_all_gather_codec(self, codec: AllGatherCodec | None,
                             params: list[str] | None = None) -> None:
        """Ours: gather the parameters named in `params` (fqns; default all) through `codec`,
        e.g. `Int8RowCodec()`; None sends them plainly again. Runs as torch's all-gather extension
        (param/extension.py): not on tensor-parallel parameters, nor reshard_after_forward=<int>."""
        unit, where = self._state().unit, self._where("set_all_gather_codec")
        by_fqn = {p.fqn: p for p in unit.params}
        names = list(by_fqn) if params is None else params
        if unknown := [n for n in names if n not in by_fqn]:
            raise ValueError(f"{where}: {unknown} are not parameters of this unit; its "
                             f"parameters are {list(by_fqn)}.")
        if codec is not None and (tp := [n for n in names if by_fqn[n].is_tensor_parallel]):
            raise NotImplementedError(f"{where}: {tp} are tensor-parallel; a codec gathers "
                                      "plain shards only. Leave them out of `params`.")
        unit.set_codecs({by_fqn[n]: codec for n in names})

    # -- torch's, not here ------------------------------------------------------------------

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Torch's; a no-op here, where every backward finishes its reductions."""

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Newer torch's; does nothing here (every backward finishes its reductions; call
        finalize_backward after backwards without sync). Checked as torch's: root, not backward."""
        state = self._state()
        if state.initialised and not state.is_root:
            raise RuntimeError(f"{self._where('set_manual_backward_finalization')}: unit "
                               f"{state.label} is not a root; call it on the root module.")
        if in_backward():
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode during backward")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """torch's (CUDA): refused with NotImplementedError."""
        _not_yet(self, "allocating communication buffers from the process group (CUDA)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """torch's (CUDA): refused with NotImplementedError."""
        _not_yet(self, "symmetric-memory communication buffers (CUDA)")


def annotated_states(modules: list[Any], where: str) -> list[UnitState]:
    if bad := [type(m).__name__ for m in modules if not isinstance(m, Setters)]:
        raise ValueError(f"{where}: {bad} are not annotated; pass modules fully_shard annotated")
    return [m._state() for m in modules]


def _at_least_one(owner: Setters, value: int, setter: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner._where(setter)}: expected an int >= 1, got {value!r}.")
    return value


def _not_yet(owner: object, what: str) -> NoReturn:
    raise NotImplementedError(
        f"{type(owner).__name__}: {what} is not supported by fsdp_compose yet.")
