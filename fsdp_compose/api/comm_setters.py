"""FSDPModule's setters for how its units communicate: the reduction's arithmetic, bounds on
the collectives in flight, and custom collectives, codecs and hooks."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from ..comm.collectives import CustomComm
from ..schedule.iteration import UnitState
from ..unit.codec import AllGatherCodec


class CommSetters:
    """A mixin of FSDPModule (api/fsdp_module.py): torch's setters, and ours."""

    # FSDPModule's: this module's unit state, and with recurse those of every unit under it.
    _state: Callable[[], UnitState]
    _states: Callable[[bool], list[UnitState]]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by `factor` instead of the mesh size."""
        self._state().settings.gradient_divide_factor = factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with a plain SUM on the wire and divide locally afterwards."""
        self._state().settings.force_sum_reduction = enable

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of `set_gradient_divide_factor`, as in torch."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            DeprecationWarning, stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_max_all_gathers_in_flight(self, limit: int) -> None:
        """Ours: at most `limit` (default 2, torch's fixed value) prefetched all-gathers in
        flight, bounding prefetch's memory. Call on the root (its units share the bound)."""
        self._set_comm_bound("max_all_gathers", limit, "set_max_all_gathers_in_flight")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """At most `max_input_buffers` (default 1) gradient reductions in flight. Call on the
        root (its units share the bound; `recurse` is only torch's signature)."""
        self._set_comm_bound("max_reductions", max_input_buffers, "set_reduce_scatter_max_input_buffers")

    def _set_comm_bound(self, attr: str, value: int, setter: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(self).__name__}.{setter}: expected an int >= 1, got {value!r}.")
        comm = self._state().comm
        setattr(comm, attr, value)
        comm.changed_by = type(self).__name__

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for parameters this rank's backward did not reach (mixture of experts),
        so all ranks send the same reduce-scatter; such a `.grad` is a tensor, never None."""
        for state in self._states(recurse):
            state.settings.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_post_optim_event(self, event: torch.Event | None) -> None:
        """The root's next forward all-gathers wait for `event` (an optimizer step on another
        stream) once: set one every iteration. None (CPU's recorded event) waits for nothing."""
        if event is not None and not callable(getattr(event, "wait", None)):
            raise TypeError(
                f"{type(self).__name__}.set_post_optim_event: expected a torch.Event, got "
                f"{type(event).__name__}."
            )
        state = self._state()
        (state.root.state if state.initialised else state).post_optim_event = event

    def set_custom_all_gather(self, comm: CustomComm) -> None:
        """Gather this unit with `comm(output, input, group, async_op=False)` -> Work | None;
        `comm.allocate(size, *, dtype, device)`, if any, allocates the output (torch's API)."""
        unit = self._state().unit  # (with several meshes, called per mesh with its group)
        unit.settings.custom_all_gather = comm
        unit.shards_replaced()  # at one rank too, the gather runs through `comm`: see Layout

    def set_custom_reduce_scatter(self, comm: CustomComm) -> None:
        """Reduce this unit's gradients with `comm(output, input, group, op, async_op=False)`;
        `comm.allocate`, if any, allocates input and output (torch's API)."""
        self._state().unit.settings.custom_reduce_scatter = comm

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call `hook(reduced)` on this unit's reduced gradients before the final division, to
        modify them in place (e.g. all-reduce across another dim); with parameters on several
        meshes (shard_placement_fn's), once per mesh with its reduced gradients (torch refuses). On an accelerator it runs on
        the reduce-scatter stream, or on `stream`, ordered both ways with it, as torch's."""
        if stream is not None and not callable(getattr(stream, "wait_stream", None)):
            raise TypeError(
                f"{type(self).__name__}.set_all_reduce_hook: stream must be a torch.Stream "
                f"or None, got {type(stream).__name__}."
            )
        settings = self._state().unit.settings
        settings.all_reduce_hook, settings.all_reduce_hook_stream = hook, stream

    def set_all_gather_codec(self, codec: AllGatherCodec | None, params: list[str] | None = None) -> None:
        """Ours: gather the parameters named in `params` (fqns; default all) through `codec`,
        e.g. `Int8RowCodec()`; None sends them plainly again."""
        unit = self._state().unit
        by_fqn = {p.fqn: p for p in unit.params}
        names = list(by_fqn) if params is None else params
        if unknown := [n for n in names if n not in by_fqn]:
            raise ValueError(
                f"{type(self).__name__}.set_all_gather_codec: {unknown} are not parameters of "
                f"this unit; its parameters are {list(by_fqn)}."
            )
        for name in names:
            unit.set_codec(by_fqn[name], codec)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter on a process group of its own, so reductions do not queue behind
        prefetched all-gathers. Collective: call it on every rank alike."""
        for state in self._states(recurse):
            state.unit.set_separate_reduce_scatter_group(enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        _not_yet(self, "allocating communication buffers from the process group (CUDA)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        _not_yet(self, "symmetric-memory communication buffers (CUDA)")


def _not_yet(owner: object, what: str) -> NoReturn:
    raise NotImplementedError(f"{type(owner).__name__}: {what} is not supported by fsdp_compose yet.")
