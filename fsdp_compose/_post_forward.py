"""reshard_after_forward=<int>: after forward, each parameter of a unit keeps its piece of a
shard over a smaller group (dim 1 of the post-forward mesh, e.g. the ranks of one node), and
the unshard before backward gathers it inside that group from those pieces."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ._param import ShardedParam
from ._sharding import shard_layout


class PostForwardShards:
    """A unit's pieces over its post-forward group, kept between forward and backward."""

    def __init__(self, params: list[ShardedParam], mesh: DeviceMesh) -> None:
        self.group: ProcessGroup = mesh.get_group(1)
        size, index = mesh.size(1), mesh.get_local_rank(1)
        self._params = params
        self._layouts = [shard_layout(p.layout.shape, size, p.layout.dim) for p in params]
        self._rows = [layout.chunk(index) for layout in self._layouts]
        self.sizes = [layout.padded_shard_numel for layout in self._layouts]  # what each sends
        self._kept: list[torch.Tensor] | None = None

    @property
    def is_kept(self) -> bool:
        return self._kept is not None

    def keep(self) -> None:
        """Copy this rank's piece of each parameter out of its unsharded data (which the
        reshard then frees)."""
        kept = []
        for p, layout, rows in zip(self._params, self._layouts, self._rows):
            unsharded = p.unsharded.detach()
            piece = unsharded.narrow(layout.dim, rows.start, len(rows))
            padded = unsharded.new_empty(layout.padded_shard_numel)  # the padding is unread
            padded[: piece.numel()].copy_(piece.reshape(-1))
            kept.append(padded)
        self._kept = kept

    def take(self) -> list[torch.Tensor]:
        """The kept pieces, no longer kept: what the all-gather inside the group sends."""
        kept, self._kept = self._kept, None
        assert kept is not None, "no post-forward pieces kept"
        return kept

    def drop(self) -> None:
        self._kept = None

    def targets(self) -> list[torch.Tensor]:
        """Where the gather inside the group lands: each parameter's unsharded data as rows
        of this layout. The group's size divides the shard size, so this padded layout is no
        longer than the full one: k * ceil(n / k) <= W * ceil(n / W) when k divides W."""
        return [
            layout.rank_rows(p.unsharded_buffer.data)
            for p, layout in zip(self._params, self._layouts)
        ]
