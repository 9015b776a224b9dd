"""reshard_after_forward=<int>: after forward, each parameter of a unit keeps its piece of a
shard over a smaller group (dim 1 of the post-forward mesh), which the next unshard gathers."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..param.sharded_param import ShardedParam
from ..param.sharding import shard_layout


class PostForwardShards:
    """A unit's pieces over its post-forward group, kept between forward and backward: as
    they are, or as bytes padded to 8 when their dtypes differ (as encode_shards does)."""

    def __init__(self, params: list[ShardedParam], mesh: DeviceMesh) -> None:
        self.group: ProcessGroup = mesh.get_group(1)
        size, index = mesh.size(1), mesh.get_local_rank(1)
        self._params = params
        self._layouts = [shard_layout(p.layout.shape, size, p.layout.dim) for p in params]
        self._rows = [layout.chunk(index) for layout in self._layouts]
        self.sizes: list[int] = []  # what each piece sends per rank, set by keep
        self.as_bytes = False  # whether the kept pieces are bytes
        self.kept: list[torch.Tensor] | None = None  # None when not kept

    def keep(self) -> None:
        """Copy this rank's piece of each parameter out of its unsharded data (then freed)."""
        kept = []
        unsharded = [p.unsharded.detach() for p in self._params]
        self.as_bytes = len({u.dtype for u in unsharded}) > 1
        for whole, layout, rows in zip(unsharded, self._layouts, self._rows):
            piece = whole.narrow(layout.dim, rows.start, len(rows))
            padded = whole.new_empty(layout.padded_shard_numel)  # the padding is unread
            padded[: piece.numel()].copy_(piece.reshape(-1))
            if self.as_bytes:
                data = padded.view(torch.uint8)
                padded = torch.nn.functional.pad(data, (0, -data.numel() % 8))
            kept.append(padded)
        self.sizes, self.kept = [piece.numel() for piece in kept], kept

    def take(self) -> list[torch.Tensor]:
        """The kept pieces, no longer kept: what the all-gather inside the group sends."""
        kept, self.kept = self.kept, None
        assert kept is not None, "fsdp_compose: no post-forward pieces kept to gather"
        return kept

    def nbytes(self) -> int:
        """What the kept pieces hold (0 when none are kept)."""
        return 0 if self.kept is None else sum(piece.nbytes for piece in self.kept)

    def copy_out(self, gathered: torch.Tensor, all_dim0: bool) -> None:
        """Write the gathered pieces (row r: group rank r's) into each parameter's unsharded
        data, as rows of this layout: no longer than the full one, as the group's size k
        divides the shard size W (k * ceil(n / k) <= W * ceil(n / W))."""
        targets = [
            layout.rank_rows(p.unsharded_buffer.data)
            for p, layout in zip(self._params, self._layouts)
        ]
        if all_dim0 and not self.as_bytes:
            torch.split_with_sizes_copy(gathered, self.sizes, dim=1, out=targets)
            return
        for target, layout, piece in zip(targets, self._layouts, gathered.split(self.sizes, dim=1)):
            if not target.numel():
                continue  # an empty parameter: nothing to write (nor to view as its dtype)
            if self.as_bytes:
                nbytes = layout.padded_shard_numel * target.element_size()
                piece = piece[:, :nbytes].view(target.dtype)
            target.copy_(piece.view(target.shape))
