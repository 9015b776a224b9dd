"""Pure shape math for sharding on one dim: torch.chunk ranges and the padded layout."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def chunk_range(dim0: int, shard_size: int, rank: int) -> range:
    """Rows of `rank`'s shard, split as torch.chunk does (trailing shards may be empty)."""
    rows = -(-dim0 // shard_size)  # ceil division
    return range(min(rank * rows, dim0), min((rank + 1) * rows, dim0))


class ShardLayout(NamedTuple):
    """One parameter cut into `shard_size` shards on `dim`, each padded to `padded_rows`: in
    rank order, the parameter then padding (dim 0) or the parameter through `rank_first`."""

    shape: torch.Size  # the unsharded parameter's shape
    shard_size: int
    dim: int  # the dim it is sharded on, from 0
    padded_rows: int  # every rank's padded shard's size on `dim`: ceil(size / shard_size)
    row_numel: int  # elements per index on `dim`

    @property
    def padded_shard_numel(self) -> int:
        return self.padded_rows * self.row_numel

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def chunk(self, rank: int) -> range:
        """`rank`'s indices on `dim`."""
        return chunk_range(self.shape[self.dim], self.shard_size, rank)

    def local_shape(self, rank: int) -> torch.Size:
        shape, dim = self.shape, self.dim
        return torch.Size((*shape[:dim], len(self.chunk(rank)), *shape[dim + 1 :]))

    def rank_first(self, whole: torch.Tensor) -> torch.Tensor:
        """`whole` (the parameter's shape) as a (shard_size, *shard shape) view; dim 0: itself."""
        if self.dim == 0:
            return whole
        split: torch.Tensor = whole.unflatten(self.dim, (self.shard_size, self.padded_rows))
        return split.movedim(self.dim, 0)

    def rank_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Where an all-gather's rows land in `flat` unsharded data (dim 0: a 2-D view)."""
        if self.dim == 0:
            return flat[: self.shard_size * self.padded_shard_numel].view(self.shard_size, -1)
        return self.rank_first(flat[: self.numel].view(self.shape))


def shard_layout(shape: torch.Size, shard_size: int, dim: int = 0) -> ShardLayout:
    """The layout of a parameter of `shape` (at least 1-D) sharded `shard_size` ways on `dim`."""
    return ShardLayout(
        torch.Size(shape), shard_size, dim, padded_rows=-(-shape[dim] // shard_size),
        row_numel=math.prod(shape[:dim]) * math.prod(shape[dim + 1 :]),
    )


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()
