"""Reducing a unit's gradients: one reduce-scatter of every unsharded gradient (and, for
HSDP, one all-reduce across replicas), into the unit's gradient ledger."""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch.distributed import Work

from ..comm import process_wide
from ..comm.collectives import (
    GradReduction,
    ReusedBuffer,
    all_reduce,
    allocate,
    collective_failed,
    grad_reduction,
    reduce_scatter,
)
from ..param.sharded_param import ShardedParam
from .held import REDUCE_INPUT, REDUCE_OUTPUT
from .layout import DtypeFacts, dtype_facts
from .part import MeshPart


class _Reduction(NamedTuple):
    """A reduce-scatter in flight: its buffers (alive until it is done), whose shards it holds."""

    work: Work | torch.Event | None
    input: torch.Tensor
    output: torch.Tensor
    params: list[ShardedParam]
    sizes: list[int]  # each parameter's padded shard
    reduction: GradReduction
    # What _post_reduce returned, where it ran already (on side streams, right after the
    # reduce-scatter); None on the CPU, where it runs once the reduce-scatter is waited for.
    final: bool | None


class Reducer:
    """Averages a part's gradients over its mesh, as the unit's settings say."""

    def __init__(self, part: MeshPart) -> None:
        self._part = part
        self.params = part.params
        self._buffer = ReusedBuffer()  # the reduce-scatter's input, unless custom allocates
        self._pending: _Reduction | None = None

    def held_by_kind(self) -> dict[str, int]:
        """Bytes held beyond the shards, by kind (see Unit.held_by_kind)."""
        output = 0 if self._pending is None else self._pending.output.nbytes
        return {REDUCE_INPUT: self._buffer.nbytes(), REDUCE_OUTPUT: output}

    def reduce_grads(self) -> bool:
        """Start averaging the unsharded gradients over the mesh; whether there were any. Only
        parameters with a gradient take part (all that require one with
        `reduce_scatter_unused_params`): which ones must agree across ranks."""
        if self._pending is not None:
            self.finish_reduction()  # this unit's reduction of an earlier part of the backward
        part, layout = self._part, self._part.layout
        if (observer := process_wide.observer) is not None:
            observer.begin(part, process_wide.ISSUE_REDUCE)
        params, grads = self._grads_to_reduce()
        if not params:
            if observer is not None:
                observer.end(part, process_wide.ISSUE_REDUCE)
            return False
        dtypes = dtype_facts(self.params) if layout is None else layout.dtypes
        settings, mesh = part.settings, part.mesh
        reduction = grad_reduction(  # from the unit's settings now
            mesh.shard_size, mesh.replicate_size, dtypes.reduce_dtype,
            settings.gradient_divide_factor, settings.force_sum_reduction, part.reduce_premul_sum,
        )
        self._pending = self._start(params, grads, dtypes, reduction)
        if observer is not None:
            observer.end(part, process_wide.ISSUE_REDUCE, self._pending.input.nbytes)
        return True

    def _start(
        self, params: list[ShardedParam], grads: list[torch.Tensor], dtypes: DtypeFacts,
        reduction: GradReduction,
    ) -> _Reduction:
        """Issue the reduce-scatter of `grads`; on side streams also _post_reduce, on the same
        stream (as torch runs them on its reduction streams, off the compute stream)."""
        part, side, final = self._part, self._part.streams, None
        custom, shard_size = part.settings.custom_reduce_scatter, part.mesh.shard_size
        rows, flat, sizes = self._chunked(params, grads, dtypes)
        work: Work | torch.Event | None
        # All on the reduce stream: overlaps compute.
        with nullcontext() if side is None else side.reducing():
            numel = flat.numel() // shard_size
            if custom is None:
                reduced = flat.new_empty(numel)  # cheaper than torch.empty with dtype and device
            else:
                reduced = allocate(custom, (numel,), flat.dtype, flat.device)
            output, input = reduced, flat
            if dtypes.is_complex:  # sent as real pairs, as torch.distributed sends them
                output, input = torch.view_as_real(reduced), torch.view_as_real(flat)
            try:
                work = reduce_scatter(output, input, part.reduce_group, shard_size, reduction,
                                      custom, async_op=side is None)
            except RuntimeError as error:
                raise collective_failed(part.label, "reduce-scatter", shard_size, error) from error
            if side is not None:
                final = self._post_reduce(params, sizes, reduced, reduction)
                work = side.reduced()
        return _Reduction(work, rows, reduced, params, sizes, reduction, final)

    def _chunked(
        self, params: list[ShardedParam], grads: list[torch.Tensor], dtypes: DtypeFacts
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The reduce-scatter's input (rows, and flat) holding `grads`, and their padded sizes."""
        part, layout = self._part, self._part.layout
        if len(params) == len(self.params) and layout is not None:
            sizes, spec = part.sizes, layout.reduce_spec
        else:
            sizes = [p.layout.padded_shard_numel for p in params]
            spec = ((part.mesh.shard_size, sum(sizes)), dtypes.reduce_dtype, part.device)
        if (custom := part.settings.custom_reduce_scatter) is None:  # row r: what rank r keeps
            rows = self._buffer.take(spec)
            flat = self._buffer.flat
        else:
            rows = allocate(custom, *spec)
            flat = rows.view(-1)
        if dtypes.mixed_dtypes:  # one dtype in: _chunk_cat needs it
            grads = [g.to(spec[1]) for g in grads]
        if not part.all_dim0:  # each rank's slice on the shard dim first: see ShardLayout
            grads = [p.layout.rank_first(g) for p, g in zip(params, grads)]
        # One op splits each gradient into shard_size dim-0 chunks as torch.chunk does,
        # pads them to the shard layout and casts to reduce_dtype. Private: docs/design.md.
        torch._chunk_cat(grads, dim=0, num_chunks=part.mesh.shard_size, out=rows)
        return rows, flat, sizes

    def _grads_to_reduce(self) -> tuple[list[ShardedParam], list[torch.Tensor]]:
        """The parameters that take part in a reduction, and their unsharded gradients."""
        ledger, unused = self._part.grads, self._part.settings.reduce_scatter_unused_params
        params, grads = [], []
        for p in self.params:  # frozen and unused ones keep .grad None, as without sharding
            if (grad := ledger.take_unsharded(p)) is None:
                if not (ledger.has_partial(p) or (unused and p.sharded.requires_grad)):
                    continue
                grad = torch.zeros(p.layout.shape, dtype=p.param_dtype, device=self._part.device)
            params.append(p)
            grads.append(grad)
        return params, grads

    def finish_reduction(self) -> None:
        """Wait for the reduction `reduce_grads` started; hold its shards until backward ends."""
        if (pending := self._pending) is None:
            return
        part, self._pending = self._part, None
        if (observer := process_wide.observer) is not None:
            observer.begin(part, process_wide.WAIT_REDUCE)
        if pending.work is not None:
            try:
                pending.work.wait()
            except RuntimeError as error:
                ranks = part.mesh.shard_size
                raise collective_failed(part.label, "reduce-scatter", ranks, error) from error
        self._buffer.release()
        if (final := pending.final) is None:
            r = pending
            final = self._post_reduce(r.params, r.sizes, r.output, r.reduction)
        if final:
            part.grads.hold(pending.params, pending.sizes, pending.output)
        if observer is not None:
            observer.end(part, process_wide.WAIT_REDUCE)

    def _post_reduce(
        self, params: list[ShardedParam], sizes: list[int], reduced: torch.Tensor,
        reduction: GradReduction,
    ) -> bool:
        """HSDP's combine_replicas, then the all-reduce hook and the division left after the
        reduction. Whether `reduced` holds final shards (not partial sums kept for HSDP)."""
        part = self._part
        if part.mesh.replicate_group is not None and not combine_replicas(
            part, params, sizes, reduced, reduction
        ):
            return False
        if part.settings.all_reduce_hook is not None:
            (hook, stream), side = part.settings.all_reduce_hook, part.streams
            with nullcontext() if side is None or stream is None else side.detour(stream):
                hook(reduced)
        if reduction.post_divide is not None:
            reduced.div_(reduction.post_divide)
        return True

    def discard(self) -> None:
        """Drop a reduction in flight (its backward did not finish)."""
        if (pending := self._pending) is not None:
            self._pending = None
            if pending.work is not None:
                pending.work.wait()  # the backend may still write into its buffers
            self._buffer.release()


def combine_replicas(
    part: MeshPart, params: list[ShardedParam], sizes: list[int], reduced: torch.Tensor,
    reduction: GradReduction,
) -> bool:
    """HSDP: add each parameter's partial sum so far to its reduced shard and all-reduce across
    replicas, or, without all-reduce (gradient accumulation), keep the shards as partial sums.
    Whether they are final."""
    mesh, ledger = part.mesh, part.grads
    shards = list(zip(params, torch.split_with_sizes(reduced, sizes)))
    for p, shard in shards:
        if (partial := ledger.take_partial(p)) is not None:
            shard.add_(partial)
    if not part.settings.requires_all_reduce:
        ledger.keep_partial(shards)
        return False
    assert mesh.replicate_group is not None
    try:
        all_reduce(reduced, reduction.all_reduce_op, mesh.replicate_group)
    except RuntimeError as error:
        raise collective_failed(part.label, "all-reduce", mesh.replicate_size, error) from error
    ledger.spend_partial(p for p, _ in shards)
    return True
