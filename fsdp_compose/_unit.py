"""A unit: the parameters one fully_shard call gathers and reduces together."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed import ProcessGroup, Work
from torch.distributed.device_mesh import DeviceMesh

from ._buffer import ReusedBuffer
from ._collectives import (
    CustomComm, GradReduction, all_gather, all_reduce, allocate, collective_failed,
    grad_reduction, reduce_scatter,
)
from ._codec import AllGatherCodec, decode_rows, encode_shards
from ._param import Registration, ShardedParam
from ._partial_sums import PartialSums
from ._streams import side_streams


class _Gather(NamedTuple):
    """An all-gather in flight: its result (row r: rank r's shards) and how to copy it out."""

    gathered: torch.Tensor  # (rows, columns)
    work: Work | torch.Event | None  # wait(): gloo blocks; an event orders the compute stream
    rows: int  # ranks gathered from
    sizes: list[int]  # each parameter's padded shard, per row (bytes if encoded)
    from_post_forward: bool
    encoded: bool  # uint8 rows of codec encodings; see encode_shards
    inputs: list[torch.Tensor] | None  # kept until waited for; see _streams.py


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


# One owning module's _parameters, and the sharded and the unsharded forms of its
# parameters in a unit, by name: what one dict update registers.
_OwnerForms = tuple[dict, dict[str, nn.Parameter], dict[str, nn.Parameter]]


class Unit:
    """Unshards its parameters with one all-gather, reduces their gradients with one
    reduce-scatter (and, for HSDP, one all-reduce across replicas). Knows nothing of
    forward or backward: see _hooks.py for when.

    On a 2-D mesh (replicate, shard) the last dimension shards and the first replicates.
    With a post-forward mesh (reshard_after_forward=<int>), resharding after forward keeps a
    piece of each parameter sharded over a smaller group, and the next unshard gathers there.
    """

    def __init__(self, params: list[ShardedParam], mesh: DeviceMesh, device: torch.device) -> None:
        self.params = params
        self.label = "<not run yet>"  # the module's fqn under its root, set at the first forward
        self.mesh = mesh
        self.device = device  # where the unsharded parameters live
        self.streams = side_streams(device)  # None on the CPU
        self.group = mesh.get_group(mesh.ndim - 1)
        self.shard_size = mesh.size(-1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_size = mesh.size(0) if mesh.ndim == 2 else 1
        self.is_unsharded = False
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self._reduction: GradReduction | None = None  # see _grad_reduction
        self.requires_all_reduce = True
        self.reduce_scatter_unused_params = False
        # Run on each reduced gradient buffer before the final division (set_all_reduce_hook).
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.reduce_scatter_group = self.group  # set_separate_reduce_scatter_group changes it
        # Extension points (FSDPModule setters): a user's collectives, per-parameter codecs.
        self.custom_all_gather: CustomComm | None = None
        self.custom_reduce_scatter: CustomComm | None = None
        self.codecs: dict[ShardedParam, AllGatherCodec] = {}
        self._partial_sums = PartialSums()  # HSDP without all-reduce
        self._gather_sizes = [p.layout.padded_shard_numel for p in params]
        self._shard_numel = sum(self._gather_sizes)  # this rank's padded shards, together
        # Weak references to an earlier `held` and to the local tensors of the `.grad`s a
        # commit made views of it; see _commit_held.
        self._grad_views: tuple[weakref.ref, list[weakref.ref]] | None = None
        # See _lay_out.
        self._laid_out = False
        self._flat: torch.Tensor | None = None
        self._flat_needs_cast = False  # to param_dtype, or to the device (CPU offload)
        self._complex = False  # whether the collectives send real pairs
        # The buffer specs (shape, dtype, device) of a gather of the flat shard and of a
        # reduction of every parameter's gradient, made once: see ReusedBuffer.take.
        self._gather_spec: tuple[tuple[int, int], torch.dtype, torch.device] | None = None
        self._reduce_spec: tuple[tuple[int, int], torch.dtype, torch.device] | None = None
        self._unsharded_storages: list[tuple[torch.UntypedStorage, int]] = []
        self._gather_targets: list[torch.Tensor] = []
        self._registrations: list[_OwnerForms] = []  # see _lay_out
        if params and not any(p.is_meta for p in params):
            self._lay_out()
        self._gather_buffer = ReusedBuffer()  # unless a custom all-gather allocates
        self._reduce_buffer = ReusedBuffer()  # the reduce-scatter's input, likewise
        self._pending_gather: _Gather | None = None
        self._pending_reduction: _Reduction | None = None
        self._held: torch.Tensor | None = None  # this backward's reduced shards; see _hold
        self._post_forward_group: ProcessGroup | None = None
        self._post_forward_kept = False  # whether the params hold post-forward shards now

    @property
    def param_dtype(self) -> torch.dtype:
        return self.params[0].param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.params[0].reduce_dtype

    def adopt_registered(self) -> None:
        """Take back parameters changed behind our back (see ShardedParam.adopt_registered)
        and follow parameters frozen or unfrozen since. Parameters change between
        iterations: forward calls this once per iteration, not at every gather."""
        for p in self.params:
            if p.adopt_registered():
                self.shards_replaced()

    def set_post_forward_mesh(self, mesh: DeviceMesh | None) -> None:
        """Reshard after forward to dim 1 of `mesh` (a smaller group), or fully if None."""
        self.reshard()
        if mesh is None:
            self._post_forward_group, size, index = None, None, 0
        else:
            self._post_forward_group = mesh.get_group(1)
            size, index = mesh.size(1), mesh.get_local_rank(1)
        for p in self.params:
            p.set_post_forward_group(size, index)

    def unshard(self, async_op: bool = False) -> None:
        """Gather the parameters; with `async_op` only start, and finish in
        `wait_for_unshard` (or in an unshard without it)."""
        if self._pending_gather is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.is_unsharded or not self.params:
            return
        side = self.streams
        if self._post_forward_kept:  # gather inside the smaller group, from kept pieces
            self._post_forward_kept = False
            group = self._post_forward_group
            rows, sizes = group.size(), [p.post_forward_numel for p in self.params]
            inputs = [p.post_forward_shard for p in self.params]
            for p in self.params:
                p.post_forward_shard = None
            written_on_compute = True
        else:
            written_on_compute = not self._laid_out
            if written_on_compute:
                self._lay_out()
            group, rows, sizes, inputs = self.group, self.shard_size, self._gather_sizes, None
        if side is None:
            self._pending_gather = self._start_gather(group, rows, sizes, inputs, async_op)
        else:
            if written_on_compute:
                side.follow_compute()  # the shards or kept pieces may still be being written
            with side.gathering():
                gather = self._start_gather(group, rows, sizes, inputs, async_op=False)
                self._pending_gather = gather._replace(work=side.gathered())
        if not async_op:
            self.wait_for_unshard()

    def _start_gather(
        self, group: ProcessGroup, rows: int, sizes: list[int],
        inputs: list[torch.Tensor] | None, async_op: bool,
    ) -> _Gather:
        """Issue the all-gather of this rank's shards (or of kept pieces, `inputs`)."""
        encoded, spec = False, None
        if inputs is not None:
            shards = torch.cat(inputs)
        elif self.codecs:
            shards, sizes = encode_shards(self.params, self.codecs, self.device, self.param_dtype)
            encoded = True
        else:
            shards, spec = self._flat_shard(), self._gather_spec
        if spec is None:
            spec = ((rows, shards.numel()), shards.dtype, self.device)
        if self.custom_all_gather is None:  # row r: rank r's shards
            gathered = self._gather_buffer.take(spec)
            flat = self._gather_buffer.flat
        else:
            shape, dtype, device = spec
            flat = allocate(self.custom_all_gather, (shape[0] * shape[1],), dtype, device)
            gathered = flat.view(shape)
        if self._complex and not encoded:  # sent as real pairs, as torch.distributed sends them
            flat, shards = torch.view_as_real(flat), torch.view_as_real(shards)
        try:
            work = all_gather(flat, shards, group, rows, async_op, self.custom_all_gather)
        except RuntimeError as error:
            raise collective_failed(self.label, "all-gather", rows, error) from error
        return _Gather(gathered, work, rows, sizes, inputs is not None, encoded, inputs)

    def _lay_out(self) -> None:
        """Put the padded shards into one flat tensor, which the all-gather sends without
        a copy-in (or with one cast, under mixed precision), and the unsharded data into
        one storage, allocated and freed at once. Parameters of different dtypes keep
        their own (their shards are copied in at each gather)."""
        params = self.params
        first = params[0].padded_shard
        self._flat, self._flat_needs_cast, self._gather_spec = None, False, None
        if all(p.padded_shard.dtype == first.dtype and p.padded_shard.device == first.device
               for p in params):
            # Parameters outlive an inference_mode forward that may get here first.
            with torch.inference_mode(False), torch.no_grad():
                flat = torch.empty(
                    self._shard_numel, dtype=first.dtype, device=first.device,
                    pin_memory=first.is_pinned(),
                )
                for p, piece in zip(params, flat.split(self._gather_sizes)):
                    p.move_shard_into(piece)
            self._flat = flat
            self._flat_needs_cast = flat.dtype != self.param_dtype or flat.device != self.device
        rows, dtype, device = self.shard_size, self.param_dtype, self.device
        if self._flat is not None:
            self._gather_spec = ((rows, self._shard_numel), dtype, device)
        self._reduce_spec = ((rows, self._shard_numel), self.reduce_dtype, device)
        self._reduction = None  # its dtype may have changed
        self._complex = dtype.is_complex
        if all(p.param_dtype == self.param_dtype for p in params):
            with torch.inference_mode(False):
                unsharded = torch.empty(
                    rows * self._shard_numel, dtype=self.param_dtype, device=self.device
                )
                pieces = unsharded.split([rows * n for n in self._gather_sizes])
                for p, piece in zip(params, pieces):
                    p.use_unsharded_buffer(piece)
            buffers = [unsharded]
        else:
            buffers = [p.unsharded_buffer for p in params]
        # Freed by resizing to 0 rather than dropped: autograd may have saved the unsharded
        # parameters, and what it saved must see the data of the next all-gather.
        self._unsharded_storages = [(b.untyped_storage(), b.nbytes) for b in buffers]
        for storage, _ in self._unsharded_storages:
            storage.resize_(0)
        self._gather_targets = [p.gather_target(from_post_forward=False) for p in params]
        # The unit registers all its parameters with one dict update per owning module (a
        # method call per parameter costs more than the work), while this layout holds.
        self._registrations = _forms_by_owner(r for p in params for r in p.registrations())
        self._laid_out = True

    def _flat_shard(self) -> torch.Tensor:
        """Every parameter's padded shard, back to back, in param_dtype (mixed precision
        gathers the dtype that computes) on the device (CPU offload gathers there)."""
        flat = self._flat
        if flat is None:
            params = self.params
            return torch.cat([p.padded_shard.to(self.device, self.param_dtype) for p in params])
        if self._flat_needs_cast:
            return flat.to(self.device, self.param_dtype, non_blocking=True)
        return flat

    def shards_replaced(self) -> None:
        """Some parameter stored a new shard (materialized, or adopted from its module):
        the next gather lays the unit out again."""
        self._laid_out = False

    @property
    def gather_in_flight(self) -> bool:
        return self._pending_gather is not None

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather: copy out into the unsharded parameters, register them."""
        if self._pending_gather is None:
            return
        gather = self._pending_gather
        self._pending_gather = None
        if gather.work is not None:
            try:
                gather.work.wait()
            except RuntimeError as error:
                raise collective_failed(self.label, "all-gather", gather.rows, error) from error
        for storage, nbytes in self._unsharded_storages:
            storage.resize_(nbytes)
        if gather.encoded:
            decode_rows(
                gather.gathered, gather.sizes, self.params, self.codecs, self._gather_targets
            )
        else:
            torch.split_with_sizes_copy(
                gather.gathered,
                gather.sizes,
                dim=1,
                out=[p.gather_target(from_post_forward=True) for p in self.params]
                if gather.from_post_forward else self._gather_targets,
            )
        self._gather_buffer.release()
        if self.streams is not None:
            self.streams.copied_out()
        if self._laid_out:
            for parameters, _, unsharded in self._registrations:
                parameters.update(unsharded)
        else:  # a parameter changed since the layout: it knows its forms
            for p in self.params:
                p.to_unsharded()
        self.is_unsharded = True

    def reshard(self, keep_post_forward: bool = False) -> None:
        """Register the sharded parameters again and free the unsharded data; with
        `keep_post_forward` and a post-forward mesh, keep each parameter's piece for it."""
        if self._pending_gather is not None:
            self.wait_for_unshard()  # an all-gather in flight must land before its buffers go
        keep = keep_post_forward and self._post_forward_group is not None
        if not self.is_unsharded:
            if not keep and self._post_forward_kept:
                self._post_forward_kept = False
                for p in self.params:
                    p.post_forward_shard = None
            return
        if keep:
            for p in self.params:
                p.keep_post_forward_shard()
        if self._laid_out:
            for parameters, sharded, _ in self._registrations:
                parameters.update(sharded)
        else:
            for p in self.params:
                p.to_sharded()
        for storage, _ in self._unsharded_storages:
            storage.resize_(0)
        self._post_forward_kept = keep
        self.is_unsharded = False

    def has_unsharded_grads(self) -> bool:
        return any(p.has_grad for p in self.params)

    def commit_backward(self) -> None:
        """The backward finished: its gradients count. See Note [gradients per backward]."""
        if self._held is not None:
            held, self._held = self._held, None
            self._commit_held(held)
        for p in self.params:
            p.commit()
        if self.replicate_group is not None:
            self._partial_sums.commit()

    def discard_backward(self) -> None:
        """The backward did not finish: forget its gradients, keep the earlier ones."""
        self._held = None
        if self._pending_reduction is not None:
            pending, self._pending_reduction = self._pending_reduction, None
            if pending.work is not None:
                pending.work.wait()  # the backend may still write into its buffers
            self._reduce_buffer.release()
        for p in self.params:
            p.discard()
        self._partial_sums.discard()

    def reduce_grads(self) -> bool:
        """Start averaging the unsharded gradients over the mesh; `finish_reduction` puts
        them into the sharded `.grad`s. Returns whether there was anything to reduce.

        Only parameters that received a gradient take part (all that require one with
        `reduce_scatter_unused_params`), so frozen and unused ones keep `.grad is None` as
        in single-process training; which ones did must agree across ranks, as it does
        whenever every rank runs the same code path.
        """
        if self._pending_reduction is not None:
            self.finish_reduction()  # this unit's reduction of an earlier part of the backward
        params, grads = self._grads_to_reduce()
        if not params:
            return False
        if len(params) == len(self.params):
            sizes, numel, spec = self._gather_sizes, self._shard_numel, self._reduce_spec
        else:
            sizes = [p.layout.padded_shard_numel for p in params]
            numel = sum(sizes)
            spec = ((self.shard_size, numel), self.reduce_dtype, self.device)
        custom = self.custom_reduce_scatter
        if custom is None:  # row r: what rank r keeps, param after param
            rows = self._reduce_buffer.take(spec)
            flat = self._reduce_buffer.flat
        else:
            rows = allocate(custom, *spec)
            flat = rows.view(-1)
        # One op splits each gradient into shard_size dim-0 chunks as torch.chunk does,
        # pads them to the shard layout and casts to reduce_dtype.
        torch._chunk_cat(grads, dim=0, num_chunks=self.shard_size, out=rows)
        reduction = self._grad_reduction()
        side = self.streams
        final = None
        if side is None:
            reduced, work = self._reduce_scatter(flat, numel, reduction, async_op=True)
        else:
            with side.reducing():
                reduced, _ = self._reduce_scatter(flat, numel, reduction, async_op=False)
                if self.replicate_group is not None:  # on this stream: it overlaps compute too
                    final = self._combine_replicas(params, sizes, reduced, reduction)
                work = side.reduced()
        self._pending_reduction = _Reduction(work, rows, reduced, params, sizes, reduction, final)
        return True

    def set_reduction(self, divide_factor: float | None, force_sum: bool) -> None:
        """Divide summed gradients by `divide_factor` (None: the number of data-parallel
        ranks); with `force_sum`, reduce with a plain SUM and divide afterwards."""
        self.gradient_divide_factor, self.force_sum_reduction = divide_factor, force_sum
        self._reduction = None

    def _grad_reduction(self) -> GradReduction:
        """How this unit's gradients are averaged, kept until its settings or its layout
        (so its reduce dtype) change: cheaper than the cached function's key, at every
        reduction."""
        if self._reduction is None:
            self._reduction = grad_reduction(
                self.shard_size, self.replicate_size, self.reduce_dtype,
                self.gradient_divide_factor, self.force_sum_reduction,
            )
        return self._reduction

    def _grads_to_reduce(self) -> tuple[list[ShardedParam], list[torch.Tensor]]:
        """The parameters that take part in a reduction, and their unsharded gradients."""
        params, grads = [], []
        for p in self.params:
            if (grad := p.take_grad()) is None:
                if not (
                    self._partial_sums.has(p)
                    or (self.reduce_scatter_unused_params and p.sharded.requires_grad)
                ):
                    continue
                grad = self._zeros(p)
            params.append(p)
            grads.append(grad)
        return params, grads

    def _reduce_scatter(
        self, flat: torch.Tensor, numel: int, reduction: GradReduction, async_op: bool
    ) -> tuple[torch.Tensor, Work | None]:
        """Reduce-scatter `flat` (row r: rank r's `numel` values) into a new tensor."""
        custom = self.custom_reduce_scatter
        if custom is None:
            reduced = flat.new_empty(numel)  # cheaper than torch.empty with dtype and device
        else:
            reduced = allocate(custom, (numel,), flat.dtype, flat.device)
        output, input = reduced, flat
        if self._complex:  # sent as real pairs, as torch.distributed sends them
            output, input = torch.view_as_real(reduced), torch.view_as_real(flat)
        try:
            work = reduce_scatter(
                output, input, self.reduce_scatter_group, self.shard_size, reduction, custom,
                async_op=async_op,
            )
        except RuntimeError as error:
            raise collective_failed(self.label, "reduce-scatter", self.shard_size, error) from error
        return reduced, work

    def finish_reduction(self) -> None:
        """Wait for the reduction `reduce_grads` started (on the CPU, all-reduce across
        HSDP replicas after it), run the all-reduce hook, divide, and hold each parameter's
        shard until the backward finishes."""
        if (pending := self._pending_reduction) is None:
            return
        self._pending_reduction = None
        if pending.work is not None:
            try:
                pending.work.wait()
            except RuntimeError as error:
                raise collective_failed(
                    self.label, "reduce-scatter", self.shard_size, error
                ) from error
        self._reduce_buffer.release()
        reduced, reduction = pending.output, pending.reduction
        if self.replicate_group is not None:
            final = pending.final
            if final is None:
                final = self._combine_replicas(pending.params, pending.sizes, reduced, reduction)
            if not final:
                return
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(reduced)
        if reduction.post_divide is not None:
            reduced.div_(reduction.post_divide)
        self._hold(pending.params, pending.sizes, reduced)

    def _combine_replicas(
        self, params: list[ShardedParam], sizes: list[int], reduced: torch.Tensor,
        reduction: GradReduction,
    ) -> bool:
        """HSDP: add each parameter's partial sum from earlier reductions to its reduced
        shard and all-reduce across replicas, or, without all-reduce, keep the shards as
        partial sums. Returns whether `reduced` holds final shards."""
        shards = list(zip(params, torch.split_with_sizes(reduced, sizes)))
        for p, shard in shards:
            if (partial := self._partial_sums.take(p)) is not None:
                shard.add_(partial)
        if not self.requires_all_reduce:
            self._partial_sums.keep(shards)
            return False
        try:
            all_reduce(reduced, reduction.all_reduce_op, self.replicate_group)
        except RuntimeError as error:
            raise collective_failed(self.label, "all-reduce", self.replicate_size, error) from error
        self._partial_sums.spend(p for p, _ in shards)
        return True

    def _hold(self, params: list[ShardedParam], sizes: list[int], reduced: torch.Tensor) -> None:
        """Keep reduced gradient shards (padded, back to back) until the backward finishes:
        whole when they are every parameter's and the first (see _commit_held), else each
        parameter its own."""
        if self._held is None and len(params) == len(self.params):
            self._held = reduced
            return
        if self._held is not None:
            self._hold_each(self.params, self._gather_sizes, self._held)
            self._held = None
        self._hold_each(params, sizes, reduced)

    @staticmethod
    def _hold_each(params: list[ShardedParam], sizes: list[int], reduced: torch.Tensor) -> None:
        for p, shard in zip(params, torch.split_with_sizes(reduced, sizes)):
            p.hold_reduced(shard)

    def _commit_held(self, held: torch.Tensor) -> None:
        """Add every parameter's reduced shard in `held` to its `.grad`. When the `.grad`s
        are still the views of an earlier `held` that a commit made them (as in gradient
        accumulation), with one add; else each its own, which makes the `.grad`s that were
        None views of `held` (ShardedParam.add_to_grad)."""
        views = self._grad_views
        if views is not None and (base := views[0]()) is not None and self._grads_are(views[1]):
            base.add_(held)
            return
        shards = torch.split_with_sizes(held, self._gather_sizes)
        locals_ = [p.add_to_grad(shard) for p, shard in zip(self.params, shards)]
        self._grad_views = None
        if all(local._base is held for local in locals_):
            self._grad_views = (weakref.ref(held), [weakref.ref(local) for local in locals_])

    def _grads_are(self, locals_: list[weakref.ref]) -> bool:
        """Whether every parameter's `.grad` has the local tensor in `locals_` (not the
        DTensor: swap_tensors, as in module.to(), keeps the object and changes its data)."""
        for p, local in zip(self.params, locals_):
            grad = p.sharded.grad  # a loop, not all() over a generator: this runs every step
            if grad is None or grad._local_tensor is not local():
                return False
        return True

    def _zeros(self, p: ShardedParam) -> torch.Tensor:
        """A gradient for a parameter only an earlier HSDP reduction saw."""
        return torch.zeros(p.layout.shape, dtype=p.param_dtype, device=self.device)


def _forms_by_owner(registrations: Iterable[Registration]) -> list[_OwnerForms]:
    """Registrations grouped by owning module."""
    by_owner: dict[int, _OwnerForms] = {}
    for r in registrations:
        _, sharded, unsharded = by_owner.setdefault(id(r.parameters), (r.parameters, {}, {}))
        sharded[r.name] = r.sharded
        unsharded[r.name] = r.unsharded
    return list(by_owner.values())
