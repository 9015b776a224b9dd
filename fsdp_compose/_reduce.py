"""Reducing a unit's gradients: one reduce-scatter of every unsharded gradient (and, for
HSDP, one all-reduce across replicas), into the unit's gradient ledger."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch.distributed import ProcessGroup, Work

from ._buffer import ReusedBuffer
from ._collectives import (
    CustomComm, GradReduction, all_reduce, allocate, collective_failed, grad_reduction,
    reduce_scatter,
)
from ._grad_ledger import GradLedger
from ._param import ShardedParam
from ._streams import SideStreams


class ReducedUnit(Protocol):
    """What a Reducer reads of its unit (see Unit)."""

    params: list[ShardedParam]
    label: str
    device: torch.device
    streams: SideStreams | None
    shard_size: int
    replicate_group: ProcessGroup | None
    replicate_size: int
    sizes: list[int]
    shard_numel: int
    is_complex: bool
    mixed_dtypes: bool
    all_dim0: bool
    grads: GradLedger

    @property
    def reduce_dtype(self) -> torch.dtype: ...


class _Reduction(NamedTuple):
    """A reduce-scatter in flight: its buffers (kept alive until it is done), and whose
    gradient shards its output holds."""

    work: Work | torch.Event | None
    input: torch.Tensor
    output: torch.Tensor
    params: list[ShardedParam]
    sizes: list[int]  # each parameter's padded shard
    reduction: GradReduction
    # HSDP: whether the output holds final shards (False: partial sums kept without an
    # all-reduce), when _combine_replicas ran already: on side streams, right after the
    # reduce-scatter. None on the CPU, where it runs once the reduce-scatter is waited for.
    final: bool | None


class Reducer:
    """Averages a unit's gradients over the mesh. Its settings are FSDPModule's setters'."""

    def __init__(self, unit: ReducedUnit, group: ProcessGroup) -> None:
        self._unit = unit
        self.params = unit.params
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.requires_all_reduce = True
        self.reduce_scatter_unused_params = False
        # Run on each reduced gradient buffer before the final division (set_all_reduce_hook).
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.group = group  # set_separate_reduce_scatter_group changes it
        self.custom_reduce_scatter: CustomComm | None = None
        self._reduction: GradReduction | None = None  # see _grad_reduction
        # The buffer spec (shape, dtype, device) of a reduction of every parameter's
        # gradient, made once per layout: see ReusedBuffer.take.
        self._spec: tuple[tuple[int, int], torch.dtype, torch.device] | None = None
        self._buffer = ReusedBuffer()  # the reduce-scatter's input, unless custom allocates
        self._pending: _Reduction | None = None

    def layout_changed(self) -> None:
        """The parameters were laid out anew: their reduce dtype may have changed."""
        unit = self._unit
        self._spec = ((unit.shard_size, unit.shard_numel), unit.reduce_dtype, unit.device)
        self._reduction = None

    def held_bytes(self) -> int:
        """Bytes held beyond the shards: the reduce-scatter's input and output in flight."""
        pending = self._pending
        output = 0 if pending is None else pending.output.nbytes
        return self._buffer.nbytes() + output

    def set_reduction(self, divide_factor: float | None, force_sum: bool) -> None:
        """Divide summed gradients by `divide_factor` (None: the number of data-parallel
        ranks); with `force_sum`, reduce with a plain SUM and divide afterwards."""
        self.gradient_divide_factor, self.force_sum_reduction = divide_factor, force_sum
        self._reduction = None

    def reduce_grads(self) -> bool:
        """Start averaging the unsharded gradients over the mesh; `finish_reduction` puts
        them into the ledger. Returns whether there was anything to reduce.

        Only parameters that received a gradient take part (all that require one with
        `reduce_scatter_unused_params`), so frozen and unused ones keep `.grad is None` as
        in single-process training; which ones did must agree across ranks, as it does
        whenever every rank runs the same code path.
        """
        if self._pending is not None:
            self.finish_reduction()  # this unit's reduction of an earlier part of the backward
        params, grads = self._grads_to_reduce()
        if not params:
            return False
        unit = self._unit
        if len(params) == len(self.params) and self._spec is not None:
            sizes, numel, spec = unit.sizes, unit.shard_numel, self._spec
        else:
            sizes = [p.layout.padded_shard_numel for p in params]
            numel = sum(sizes)
            spec = ((unit.shard_size, numel), unit.reduce_dtype, unit.device)
        custom = self.custom_reduce_scatter
        if custom is None:  # row r: what rank r keeps, param after param
            rows = self._buffer.take(spec)
            flat = self._buffer.flat
        else:
            rows = allocate(custom, *spec)
            flat = rows.view(-1)
        if unit.mixed_dtypes:  # one dtype in: _chunk_cat needs it
            grads = [g.to(spec[1]) for g in grads]
        if not unit.all_dim0:  # each rank's slice on the shard dim first: see ShardLayout
            grads = [p.layout.rank_first(g) for p, g in zip(params, grads)]
        # One op splits each gradient into shard_size dim-0 chunks as torch.chunk does,
        # pads them to the shard layout and casts to reduce_dtype. Private: docs/design.md.
        torch._chunk_cat(grads, dim=0, num_chunks=unit.shard_size, out=rows)
        reduction = self._grad_reduction()
        side = unit.streams
        final = None
        work: Work | torch.Event | None
        if side is None:
            reduced, work = self._reduce_scatter(flat, numel, reduction, async_op=True)
        else:
            with side.reducing():
                reduced, _ = self._reduce_scatter(flat, numel, reduction, async_op=False)
                if unit.replicate_group is not None:  # on this stream: it overlaps compute too
                    final = self._combine_replicas(params, sizes, reduced, reduction)
                work = side.reduced()
        self._pending = _Reduction(work, rows, reduced, params, sizes, reduction, final)
        return True

    def _grad_reduction(self) -> GradReduction:
        """How this unit's gradients are averaged, kept until its settings or its layout
        (so its reduce dtype) change: cheaper than the cached function's key, at every
        reduction."""
        if self._reduction is None:
            unit = self._unit
            self._reduction = grad_reduction(
                unit.shard_size, unit.replicate_size, unit.reduce_dtype,
                self.gradient_divide_factor, self.force_sum_reduction,
            )
        return self._reduction

    def _grads_to_reduce(self) -> tuple[list[ShardedParam], list[torch.Tensor]]:
        """The parameters that take part in a reduction, and their unsharded gradients."""
        ledger = self._unit.grads
        params, grads = [], []
        for p in self.params:
            if (grad := ledger.take_unsharded(p)) is None:
                if not (
                    ledger.has_partial(p)
                    or (self.reduce_scatter_unused_params and p.sharded.requires_grad)
                ):
                    continue
                grad = torch.zeros(p.layout.shape, dtype=p.param_dtype, device=self._unit.device)
            params.append(p)
            grads.append(grad)
        return params, grads

    def _reduce_scatter(
        self, flat: torch.Tensor, numel: int, reduction: GradReduction, async_op: bool
    ) -> tuple[torch.Tensor, Work | None]:
        """Reduce-scatter `flat` (row r: rank r's `numel` values) into a new tensor."""
        unit, custom = self._unit, self.custom_reduce_scatter
        if custom is None:
            reduced = flat.new_empty(numel)  # cheaper than torch.empty with dtype and device
        else:
            reduced = allocate(custom, (numel,), flat.dtype, flat.device)
        output, input = reduced, flat
        if unit.is_complex:  # sent as real pairs, as torch.distributed sends them
            output, input = torch.view_as_real(reduced), torch.view_as_real(flat)
        try:
            work = reduce_scatter(
                output, input, self.group, unit.shard_size, reduction, custom, async_op=async_op,
            )
        except RuntimeError as error:
            raise collective_failed(unit.label, "reduce-scatter", unit.shard_size, error) from error
        return reduced, work

    def finish_reduction(self) -> None:
        """Wait for the reduction `reduce_grads` started (on the CPU, all-reduce across
        HSDP replicas after it), run the all-reduce hook, divide, and hold each parameter's
        shard in the ledger until the backward finishes."""
        if (pending := self._pending) is None:
            return
        self._pending = None
        unit = self._unit
        if pending.work is not None:
            try:
                pending.work.wait()
            except RuntimeError as error:
                raise collective_failed(
                    unit.label, "reduce-scatter", unit.shard_size, error
                ) from error
        self._buffer.release()
        reduced, reduction = pending.output, pending.reduction
        if unit.replicate_group is not None:
            final = pending.final
            if final is None:
                final = self._combine_replicas(pending.params, pending.sizes, reduced, reduction)
            if not final:
                return
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(reduced)
        if reduction.post_divide is not None:
            reduced.div_(reduction.post_divide)
        unit.grads.hold(pending.params, pending.sizes, reduced)

    def _combine_replicas(
        self, params: list[ShardedParam], sizes: list[int], reduced: torch.Tensor,
        reduction: GradReduction,
    ) -> bool:
        """HSDP: add each parameter's partial sum from earlier reductions to its reduced
        shard and all-reduce across replicas, or, without all-reduce, keep the shards as
        partial sums. Returns whether `reduced` holds final shards."""
        unit, ledger = self._unit, self._unit.grads
        shards = list(zip(params, torch.split_with_sizes(reduced, sizes)))
        for p, shard in shards:
            if (partial := ledger.take_partial(p)) is not None:
                shard.add_(partial)
        if not self.requires_all_reduce:
            ledger.keep_partial(shards)
            return False
        assert unit.replicate_group is not None
        try:
            all_reduce(reduced, reduction.all_reduce_op, unit.replicate_group)
        except RuntimeError as error:
            raise collective_failed(unit.label, "all-reduce", unit.replicate_size, error) from error
        ledger.spend_partial(p for p, _ in shards)
        return True

    def discard(self) -> None:
        """Drop a reduction in flight (its backward did not finish)."""
        if (pending := self._pending) is not None:
            self._pending = None
            if pending.work is not None:
                pending.work.wait()  # the backend may still write into its buffers
            self._buffer.release()
