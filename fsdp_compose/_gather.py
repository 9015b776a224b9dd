"""Gathering a unit: one all-gather of every parameter's shard into the unsharded
parameters, and back (reshard), over the memory layout of _layout.py."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch.distributed import ProcessGroup, Work
from torch.distributed.device_mesh import DeviceMesh

from ._buffer import ReusedBuffer
from ._codec import AllGatherCodec, decode_rows, encode_shards
from ._collectives import CustomComm, all_gather, allocate, collective_failed
from ._extension import GatherExtension, carried_problem, has_extension
from ._meshes import shard_mesh
from ._layout import OwnerForms, flat_shards, forms_by_owner, unsharded_buffers
from ._param import ShardedParam
from ._post_forward import PostForwardShards
from ._streams import SideStreams


class GatheredUnit(Protocol):
    """What a Gatherer reads of its unit (see Unit)."""

    params: list[ShardedParam]
    label: str
    mesh: DeviceMesh
    device: torch.device
    streams: SideStreams | None
    group: ProcessGroup
    shard_size: int
    sizes: list[int]
    shard_numel: int
    is_complex: bool
    mixed_dtypes: bool
    all_dim0: bool  # every parameter sharded on dim 0: its gather target is 2-D rows
    codecs: dict[ShardedParam, AllGatherCodec]
    custom_all_gather: CustomComm | None

    @property
    def param_dtype(self) -> torch.dtype: ...
    def layout_changed(self) -> None: ...
    def meta_problem(self) -> str | None: ...


class _Gather(NamedTuple):
    """An all-gather in flight: its result (row r: rank r's shards) and how to copy it out."""

    gathered: torch.Tensor  # (rows, columns)
    work: Work | torch.Event | None  # wait(): gloo blocks; an event orders the compute stream
    rows: int  # ranks gathered from
    sizes: list[int]  # each parameter's padded shard, per row (bytes if encoded)
    from_post_forward: bool
    encoded: bool  # uint8 rows of codec encodings; see encode_shards
    inputs: list[torch.Tensor] | None  # kept until waited for; see _streams.py


class Gatherer:
    """Unshards a unit's parameters with one all-gather and reshards them. With a
    post-forward mesh (reshard_after_forward=<int>), resharding after forward keeps a piece
    of each parameter sharded over a smaller group, and the next unshard gathers there."""

    def __init__(self, unit: GatheredUnit) -> None:
        self._unit = unit
        self.params = unit.params
        self.is_unsharded = False
        self.keep_unsharded_storage = False  # set_keep_unsharded_storage (e.g. CUDA graphs)
        self.laid_out = False  # see lay_out
        self._flat: torch.Tensor | None = None
        self._flat_needs_cast = False  # to param_dtype, or to the device (CPU offload)
        # The buffer spec (shape, dtype, device) of a gather of the flat shard, made once:
        # see ReusedBuffer.take.
        self._spec: tuple[tuple[int, int], torch.dtype, torch.device] | None = None
        self._unsharded_storages: list[tuple[torch.UntypedStorage, int]] = []
        self._storage_allocated = False  # whether _unsharded_storages hold their bytes
        self._targets: list[torch.Tensor] = []
        self._registrations: list[OwnerForms] = []  # see lay_out
        self._extended: list[ShardedParam] = []  # with all-gather hooks: see _extension.py
        self._buffer = ReusedBuffer()  # unless a custom all-gather allocates
        self._pending: _Gather | None = None
        self._post_forward: PostForwardShards | None = None

    def set_post_forward_mesh(self, mesh: DeviceMesh | None) -> None:
        """Reshard after forward to dim 1 of `mesh` (a smaller group), or fully if None."""
        self.reshard()
        if mesh is not None:
            self._check_extended()
        self._post_forward = None if mesh is None else PostForwardShards(self.params, mesh)

    def held_bytes(self) -> int:
        """Bytes held beyond the shards: unsharded data and the all-gather buffer."""
        unsharded = sum(storage.nbytes() for storage, _ in self._unsharded_storages)
        return unsharded + self._buffer.nbytes()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def unshard(self, async_op: bool = False) -> None:
        """Gather the parameters; with `async_op` only start, and finish in
        `wait_for_unshard` (or in an unshard without it)."""
        if self._pending is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.is_unsharded or not self.params:
            return
        unit = self._unit
        side = unit.streams
        post_forward = self._post_forward
        if post_forward is not None and post_forward.is_kept:  # inside the smaller group
            group, sizes, inputs = post_forward.group, post_forward.sizes, post_forward.take()
            rows = group.size()
            written_on_compute = True
        else:
            written_on_compute = not self.laid_out
            if written_on_compute:
                self.lay_out()
            group, rows, sizes, inputs = unit.group, unit.shard_size, unit.sizes, None
        if side is None:
            self._pending = self._start(group, rows, sizes, inputs, async_op)
        else:
            if written_on_compute:
                side.follow_compute()  # the shards or kept pieces may still be being written
            with side.gathering():
                gather = self._start(group, rows, sizes, inputs, async_op=False)
                self._pending = gather._replace(work=side.gathered())
        if not async_op:
            self.wait_for_unshard()

    def _start(
        self, group: ProcessGroup, rows: int, sizes: list[int],
        inputs: list[torch.Tensor] | None, async_op: bool,
    ) -> _Gather:
        """Issue the all-gather of this rank's shards (or of kept pieces, `inputs`)."""
        unit = self._unit
        encoded, spec = False, None
        if inputs is not None:
            shards = torch.cat(inputs)
            encoded = self._post_forward is not None and self._post_forward.as_bytes
        elif unit.codecs or unit.mixed_dtypes or self._extended:  # bytes: see encode_shards
            shards, sizes = encode_shards(self.params, unit.codecs, unit.device)
            encoded = True
        else:
            shards, spec = self._flat_shard(), self._spec
        if spec is None:
            spec = ((rows, shards.numel()), shards.dtype, unit.device)
        custom = unit.custom_all_gather
        if custom is None:  # row r: rank r's shards
            gathered = self._buffer.take(spec)
            flat = self._buffer.flat
        else:
            shape, dtype, device = spec
            flat = allocate(custom, (shape[0] * shape[1],), dtype, device)
            gathered = flat.view(shape)
        if unit.is_complex and not encoded:  # sent as real pairs, as torch.distributed does
            flat, shards = torch.view_as_real(flat), torch.view_as_real(shards)
        try:
            work = all_gather(flat, shards, group, rows, async_op, custom)
        except RuntimeError as error:
            raise collective_failed(unit.label, "all-gather", rows, error) from error
        return _Gather(gathered, work, rows, sizes, inputs is not None, encoded, inputs)

    def lay_out(self, before_gather: bool = True) -> None:
        """Put the padded shards into one flat tensor, which the all-gather sends without
        a copy-in (or with one cast, under mixed precision), and the unsharded data into
        one storage, allocated and freed at once. Parameters of different dtypes keep
        their own (their shards are copied in at each gather).

        Not `before_gather` (fully_shard lays a unit out at once), a tensor subclass whose
        all-gather hooks are not attached yet leaves the unit to be laid out at its first
        gather, which refuses it if they still are not (torch allows attaching them after
        fully_shard)."""
        unit, params = self._unit, self.params
        if (problem := unit.meta_problem()) is not None:
            raise RuntimeError(problem)
        if not self._find_extensions(refuse_unhooked=before_gather):
            return
        self._flat, self._flat_needs_cast, self._spec = None, False, None
        if not self._extended:
            self._flat = flat_shards(params, unit.shard_numel)
        rows, dtype, device = unit.shard_size, unit.param_dtype, unit.device
        if self._flat is not None:
            self._flat_needs_cast = self._flat.dtype != dtype or self._flat.device != device
            self._spec = ((rows, unit.shard_numel), dtype, device)
        unit.layout_changed()
        plain = [i for i, p in enumerate(params) if p.extension is None]  # hooks build theirs
        buffers = unsharded_buffers(
            [params[i] for i in plain], rows, [unit.sizes[i] for i in plain], dtype, device
        ) if plain else []
        # Freed by resizing to 0 rather than dropped: autograd may have saved the unsharded
        # parameters, and what it saved must see the data of the next all-gather.
        self._unsharded_storages = [(b.untyped_storage(), b.nbytes) for b in buffers]
        for storage, _ in self._unsharded_storages:
            storage.resize_(0)
        self._storage_allocated = False
        self._targets = [p.gather_target for p in params]
        # The unit registers all its parameters with one dict update per owning module (a
        # method call per parameter costs more than the work), while this layout holds.
        self._registrations = forms_by_owner(r for p in params for r in p.registrations())
        self.laid_out = True

    def _find_extensions(self, refuse_unhooked: bool) -> bool:
        """Give each parameter whose local shard has all-gather hooks its GatherExtension
        (kept while the shard is the same), and no other parameter one. Whether every
        tensor-subclass shard has hooks; with `refuse_unhooked`, one without raises."""
        unit = self._unit
        for p in self.params:
            where = f"fsdp_compose: unit {unit.label}: parameter {p.fqn!r}"
            if not has_extension(p.local, where):
                if (problem := carried_problem(where, p.local)) is not None:
                    if refuse_unhooked:  # on every rank alike: they hold the same model
                        raise TypeError(problem)
                    return False
                p.extension = None
            elif p.extension is None:
                p.extension = GatherExtension(
                    p.fqn, p.owners[0][0], shard_mesh(unit.mesh), p.shape, p.mp_policy
                )
        self._extended = [p for p in self.params if p.extension is not None]
        if self._post_forward is not None:
            self._check_extended()
        return True

    def _check_extended(self) -> None:
        if self._extended:
            raise NotImplementedError(
                f"fsdp_compose: unit {self._unit.label}: parameter {self._extended[0].fqn!r} "
                "has all-gather hooks (fsdp_pre_all_gather), which reshard_after_forward=<int> "
                "cannot keep a piece of (torch's fully_shard refuses this too); pass a bool."
            )

    def _flat_shard(self) -> torch.Tensor:
        """Every parameter's padded shard, back to back, in param_dtype (mixed precision
        gathers the dtype that computes) on the device (CPU offload gathers there)."""
        unit, flat = self._unit, self._flat
        if flat is None:
            return torch.cat([p.padded_shard.to(unit.device, unit.param_dtype) for p in self.params])
        if self._flat_needs_cast:
            return flat.to(unit.device, unit.param_dtype, non_blocking=True)
        return flat

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather: copy out into the unsharded parameters, register them."""
        if self._pending is None:
            return
        gather, unit = self._pending, self._unit
        self._pending = None
        if gather.work is not None:
            try:
                gather.work.wait()
            except RuntimeError as error:
                raise collective_failed(unit.label, "all-gather", gather.rows, error) from error
        if not self._storage_allocated:  # resize_ reallocates even to the same size
            for storage, nbytes in self._unsharded_storages:
                storage.resize_(nbytes)
            self._storage_allocated = True
        targets = self._targets
        if gather.from_post_forward:
            assert self._post_forward is not None
            self._post_forward.copy_out(gather.gathered, unit.all_dim0)
        elif gather.encoded:
            if decode_rows(gather.gathered, gather.sizes, self.params, unit.codecs, targets):
                self._registrations = forms_by_owner(  # a hook built an unsharded parameter
                    r for p in self.params for r in p.registrations()
                )
        elif unit.all_dim0:
            torch.split_with_sizes_copy(gather.gathered, gather.sizes, dim=1, out=targets)
        else:  # some parameter is sharded on another dim: its target is strided
            for target, piece in zip(targets, torch.split(gather.gathered, gather.sizes, dim=1)):
                target.copy_(piece.view(target.shape))
        self._buffer.release()
        if unit.streams is not None:
            unit.streams.copied_out()
        if self.laid_out:
            for parameters, _, unsharded in self._registrations:
                parameters.update(unsharded)
        else:  # a parameter changed since the layout: it knows its forms
            for p in self.params:
                p.to_unsharded()
        self.is_unsharded = True

    def reshard(self, keep_post_forward: bool = False) -> None:
        """Register the sharded parameters again and free the unsharded data; with
        `keep_post_forward` and a post-forward mesh, keep each parameter's piece for it."""
        if self._pending is not None:
            self.wait_for_unshard()  # an all-gather in flight must land before its buffers go
        post_forward = self._post_forward if keep_post_forward else None
        if not self.is_unsharded:
            if post_forward is None and self._post_forward is not None:
                self._post_forward.drop()  # a full reshard: the kept pieces are not needed
            return
        if post_forward is not None:
            post_forward.keep()
        if self.laid_out:
            for parameters, sharded, _ in self._registrations:
                parameters.update(sharded)
        else:
            for p in self.params:
                p.to_sharded()
        if not self.keep_unsharded_storage:
            for storage, _ in self._unsharded_storages:
                storage.resize_(0)
            self._storage_allocated = False
            for p in self._extended:
                assert p.extension is not None
                p.extension.free()
        self.is_unsharded = False
