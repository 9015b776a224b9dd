"""Shape math of dim-0 sharding, checked against torch.chunk."""

from __future__ import annotations

import pytest
import torch

from fsdp_compose.param.sharding import chunk_range, contiguous_stride, shard_layout


@pytest.mark.parametrize("shard_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dim0", [1, 2, 3, 5, 7, 8, 16, 17])
def test_chunk_range_matches_torch_chunk(dim0, shard_size):
    rows = torch.arange(dim0)
    chunks = torch.chunk(rows, shard_size)
    for rank in range(shard_size):
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(chunk_range(dim0, shard_size, rank)) == expected


def test_layout_pads_every_shard_to_the_largest():
    layout = shard_layout(torch.Size((7, 3)), 4)
    assert (layout.padded_rows, layout.row_numel, layout.padded_shard_numel) == (2, 3, 6)
    assert [layout.local_shape(r) for r in range(4)] == [
        torch.Size((2, 3)), torch.Size((2, 3)), torch.Size((2, 3)), torch.Size((1, 3))
    ]


def test_layout_of_a_vector_shorter_than_the_mesh():
    layout = shard_layout(torch.Size((3,)), 4)
    assert (layout.padded_rows, layout.row_numel) == (1, 1)
    assert [layout.local_shape(r)[0] for r in range(4)] == [1, 1, 1, 0]


@pytest.mark.parametrize("shape", [(5,), (7, 3), (2, 0, 4), (3, 4, 5)])
def test_contiguous_stride_matches_torch(shape):
    assert contiguous_stride(torch.Size(shape)) == torch.empty(shape).stride()
