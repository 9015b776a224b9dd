"""Gathering a unit: one all-gather of every parameter's shard into the unsharded
parameters, and back (reshard), over the memory layout of unit/layout.py."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, Work
from torch.distributed.device_mesh import DeviceMesh

from ..comm import process_wide
from ..comm.collectives import ReusedBuffer, all_gather, allocate, collective_failed
from ..param.sharded_param import ShardedParam
from .held import GATHERED, POST_FORWARD, UNSHARDED
from .layout import Layout
from .part import MeshPart
from .post_forward import PostForwardShards


class _Gather(NamedTuple):
    """An all-gather in flight: its result (row r: rank r's shards) and how to copy it out."""

    gathered: torch.Tensor  # (ranks gathered from, columns)
    work: Work | torch.Event | None  # wait(): gloo blocks; an event orders the compute stream
    sizes: list[int]  # each parameter's padded shard, per row (bytes if encoded)
    encoded: bool  # uint8 rows: see encode_shards
    inputs: list[torch.Tensor] | None  # kept pieces sent, alive until waited for (comm/streams.py)
    layout: Layout  # the part's when it started: where the rows land


class Gatherer:
    """Unshards a part's parameters with one all-gather and reshards them; with a post-forward
    mesh, a reshard after forward keeps pieces (see PostForwardShards) the next unshard gathers."""

    def __init__(self, part: MeshPart) -> None:
        self._part = part
        self.params = part.params
        self.is_unsharded = False
        self._allocated: Layout | None = None  # the layout whose storages hold their bytes
        self._buffer = ReusedBuffer()  # unless a custom all-gather allocates
        self._pending: _Gather | None = None
        self._post_forward: PostForwardShards | None = None
        # This rank's row of the reused output and its pieces, for the layout they were cut for.
        self._row: tuple[torch.Tensor, Layout, torch.Tensor, list[torch.Tensor]] | None = None

    def set_post_forward_mesh(self, mesh: DeviceMesh | None) -> None:
        """Reshard after forward to dim 1 of `mesh` (a smaller group), or fully if None."""
        self.reshard()
        if mesh is not None:
            self._check_extended()
        self._post_forward = None if mesh is None else PostForwardShards(self.params, mesh)

    def held_by_kind(self) -> dict[str, int]:
        """Bytes held beyond the shards, by kind (see Unit.held_by_kind)."""
        storages = () if self._allocated is None else self._allocated.storages
        return {
            UNSHARDED: sum(storage.nbytes() for storage, _ in storages),
            GATHERED: self._buffer.nbytes(),
            POST_FORWARD: 0 if self._post_forward is None else self._post_forward.nbytes(),
        }

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def unshard(self, async_op: bool = False) -> None:
        """Gather the parameters; with `async_op` only start (`wait_for_unshard` finishes)."""
        if self._pending is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.is_unsharded or not self.params:
            return
        part, side, post_forward = self._part, self._part.streams, self._post_forward
        if post_forward is not None and post_forward.kept is not None:  # inside the smaller group
            group, sizes, inputs = post_forward.group, post_forward.sizes, post_forward.take()
            rows, written_on_compute = group.size(), True
        else:
            layout = part.layout
            # A new layout: its unsharded storages come freed.
            if written_on_compute := layout is None:
                layout, self._allocated = part.lay_out(), None
                if post_forward is not None:
                    self._check_extended()
            if layout is not None and (layout.zero_copy or layout.cast_in is not None):
                if layout.cast_in is not None:  # one foreach copy, on this stream: see Layout
                    self._allocate(layout)
                    torch._foreach_copy_(*layout.cast_in, non_blocking=True)
                self._register(unsharded=True)  # zero_copy: the shards are the unsharded data
                return
            mesh, sizes, inputs = part.mesh, part.sizes, None
            group, rows = mesh.shard_group, mesh.shard_size
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
        part = self._part
        if (observer := process_wide.observer) is not None:
            observer.begin(part, process_wide.ISSUE_GATHER)
        layout = part.layout
        assert layout is not None, "laid out by unshard"
        encoded, spec, copied_in = False, None, None
        if inputs is not None:
            shards = torch.cat(inputs)
            encoded = self._post_forward is not None and self._post_forward.as_bytes
        elif layout.dtypes.mixed_dtypes or layout.extended:  # parameters that travel as bytes
            shards, sizes = encode_shards(self.params, part.device)
            encoded = True
        else:  # copied into this rank's row of the output below, as torch's fully_shard does
            spec, copied_in = layout.gather_spec, layout.shards
        if spec is None:
            spec = ((rows, shards.numel()), shards.dtype, part.device)
        custom = part.settings.custom_all_gather
        if custom is None:  # row r: rank r's shards
            gathered = self._buffer.take(spec)
            flat = self._buffer.flat
        else:
            shape, dtype, device = spec
            flat = allocate(custom, (shape[0] * shape[1],), dtype, device)
            gathered = flat.view(shape)
        if copied_in is not None:  # in param_dtype (mixed precision), onto the device (offload)
            if (row := self._row) is None or row[0] is not gathered or row[1] is not layout:
                shards = gathered[part.mesh.shard_rank]
                row = self._row = gathered, layout, shards, list(shards.split(sizes))
            shards = row[2]
            torch._foreach_copy_(row[3], copied_in, non_blocking=True)
        if layout.dtypes.is_complex and not encoded:  # sent as real pairs, as torch does
            flat, shards = torch.view_as_real(flat), torch.view_as_real(shards)
        try:
            work = all_gather(flat, shards, group, rows, async_op, custom)
        except RuntimeError as error:
            raise collective_failed(part.label, "all-gather", rows, error) from error
        if observer is not None:
            observer.end(part, process_wide.ISSUE_GATHER, gathered.nbytes)
        return _Gather(gathered, work, sizes, encoded, inputs, layout)

    def _allocate(self, layout: Layout) -> None:
        """Give `layout`'s unsharded storages their bytes, unless they hold them already."""
        if self._allocated is not layout:  # resize_ reallocates even to the same size
            for storage, nbytes in layout.storages:
                storage.resize_(nbytes)
            self._allocated = layout

    def _check_extended(self) -> None:
        layout = self._part.layout
        if layout is not None and layout.extended:
            raise NotImplementedError(
                f"fsdp_compose: unit {self._part.label}: parameter {layout.extended[0].fqn!r} "
                "gathers through an all-gather extension (fsdp_pre_all_gather, or a codec), "
                "which reshard_after_forward=<int> cannot keep a piece of (torch's fully_shard "
                "refuses this too); pass a bool."
            )

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather: copy out into the unsharded parameters, register them."""
        if (gather := self._pending) is None:
            return
        part, self._pending = self._part, None
        if (observer := process_wide.observer) is not None:
            observer.begin(part, process_wide.WAIT_GATHER)
        if gather.work is not None:
            try:
                gather.work.wait()
            except RuntimeError as error:
                ranks = len(gather.gathered)
                raise collective_failed(part.label, "all-gather", ranks, error) from error
        self._allocate(gather.layout)
        self._copy_out(gather)
        self._buffer.release()
        if part.streams is not None:
            part.streams.copied_out()
        self._register(unsharded=True)
        if observer is not None:
            observer.end(part, process_wide.WAIT_GATHER)

    def _register(self, unsharded: bool) -> None:
        """Register the unsharded (or the sharded) parameters on their modules."""
        if (layout := self._part.layout) is not None:
            for parameters, sharded_forms, unsharded_forms in layout.registrations:
                parameters.update(unsharded_forms if unsharded else sharded_forms)
        else:  # a parameter changed since the layout: it knows its forms
            for p in self.params:
                if unsharded:
                    p.to_unsharded()
                else:
                    p.to_sharded()
        self.is_unsharded = unsharded

    def _copy_out(self, gather: _Gather) -> None:
        """Write the gathered rows into each parameter's unsharded data."""
        part, targets, gathered = self._part, gather.layout.targets, gather.gathered
        if gather.inputs is not None:
            assert self._post_forward is not None
            self._post_forward.copy_out(gathered, part.all_dim0)
        elif gather.encoded:
            if decode_rows(gathered, gather.sizes, self.params, targets):
                part.registrations_changed(gather.layout)  # a hook built an unsharded parameter
        elif part.all_dim0:
            torch.split_with_sizes_copy(gathered, gather.sizes, dim=1, out=targets)
        else:  # some parameter is sharded on another dim: its target is strided
            for target, piece in zip(targets, torch.split(gathered, gather.sizes, dim=1)):
                target.copy_(piece.view(target.shape))

    def reshard(self, keep_post_forward: bool = False) -> None:
        """Register the sharded parameters again and free the unsharded data; with
        `keep_post_forward` and a post-forward mesh, keep each parameter's piece for it."""
        if self._pending is not None:
            self.wait_for_unshard()  # an all-gather in flight must land before its buffers go
        post_forward = self._post_forward if keep_post_forward else None
        if not self.is_unsharded:
            if post_forward is None and self._post_forward is not None:
                self._post_forward.kept = None  # a full reshard: the kept pieces are not needed
            return
        if post_forward is not None:
            post_forward.keep()
        self._register(unsharded=False)
        keep = self._part.settings.keep_unsharded_storage  # e.g. for CUDA graphs
        if not keep and (allocated := self._allocated) is not None:
            for storage, _ in allocated.storages:
                storage.resize_(0)
            self._allocated = None
            for p in allocated.extended:
                assert p.extension is not None
                p.extension.free()


# -- a part whose parameters cannot travel as one dtype: some gather through an all-gather
# extension (param/extension.py), or they compute in different dtypes


def encode_shards(params: list[ShardedParam], device: torch.device) -> tuple[Tensor, list[int]]:
    """What a rank sends and each parameter's share: what its extension sends, or its shard
    in its dtype, as bytes padded to 8 (to be viewed in any dtype again)."""
    pieces = []
    for p in params:
        if p.extension is not None:  # the hooks choose: see param/extension.py
            local = p.local if p.local.device == device else p.local.to(device, non_blocking=True)
            pieces.append(p.extension.encode(local))
            continue
        data = p.padded_shard.to(device, p.param_dtype, non_blocking=True).view(torch.uint8)
        pieces.append(torch.nn.functional.pad(data, (0, -data.numel() % 8)))
    return torch.cat(pieces), [piece.numel() for piece in pieces]


def decode_rows(
    gathered: Tensor, sizes: list[int], params: list[ShardedParam], outs: list[Tensor],
) -> bool:
    """Write each parameter's unsharded data into `outs` from the gathered bytes (row r: rank
    r's encode_shards); whether all-gather hooks built a new unsharded parameter (at first)."""
    built = False
    for out, p, data in zip(outs, params, torch.split(gathered, sizes, dim=1)):
        if p.extension is not None:
            new = p.extension.decode(data, p.local, p.param_dtype, p.sharded.requires_grad)
            if new is not None:
                p.unsharded, built = new, True
            continue
        values = data[:, : p.layout.padded_shard_numel * out.element_size()].view(out.dtype)
        out.copy_(values.view(out.shape))
    return built
