"""Pure shape math for dim-0 sharding: torch.chunk ranges and the padded communication layout."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def chunk_range(dim0: int, shard_size: int, rank: int) -> range:
    """Rows of `rank`'s shard, split as torch.chunk does (trailing shards may be empty)."""
    rows = -(-dim0 // shard_size)  # ceil division
    return range(min(rank * rows, dim0), min((rank + 1) * rows, dim0))


class ShardLayout(NamedTuple):
    """How one parameter is cut into `shard_size` dim-0 shards and padded for communication.

    Every rank's shard is padded to `padded_rows` rows, so an all-gather of the padded
    shards, read rank after rank, is the parameter followed by padding rows.
    """

    shape: torch.Size  # the unsharded parameter's shape
    shard_size: int
    padded_rows: int  # rows of every rank's padded shard: ceil(dim0 / shard_size)
    row_numel: int  # elements per dim-0 row

    @property
    def padded_shard_numel(self) -> int:
        return self.padded_rows * self.row_numel

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def local_shape(self, rank: int) -> torch.Size:
        rows = len(chunk_range(self.shape[0], self.shard_size, rank))
        return torch.Size((rows, *self.shape[1:]))


def shard_layout(shape: torch.Size, shard_size: int) -> ShardLayout:
    """The layout of a parameter of `shape` (at least 1-D) sharded `shard_size` ways on dim 0."""
    return ShardLayout(
        shape=torch.Size(shape),
        shard_size=shard_size,
        padded_rows=-(-shape[0] // shard_size),
        row_numel=math.prod(shape[1:]),
    )


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The stride of a contiguous tensor of `shape`."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
