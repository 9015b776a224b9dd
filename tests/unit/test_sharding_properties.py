"""The sharding arithmetic, checked by property over generated shapes and shard sizes
against torch.chunk and against DTensor's own placements (Shard(dim) on a mesh): chunk
ranges, padding, empty shards, local shapes, the all-gather's rows and the copy-out views,
and the post-forward pieces over a smaller group. No process group: the meshes are built
without one, for one rank at a time."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_compose.param.sharding import chunk_range, shard_layout
from fsdp_compose.unit.post_forward import PostForwardShards

# Each example is a few tensor ops; a hundred per property keeps the file at seconds.
FAST = settings(max_examples=100, deadline=None)

shard_sizes = st.integers(min_value=1, max_value=12)


@st.composite
def layouts(draw: st.DrawFn, even: bool = False) -> tuple[torch.Size, int, int]:
    """(shape, dim, shard_size): 1 to 3 dims of 0 to 9 (empty parameters and empty shards
    included). With `even`, a dim other than 0 splits evenly, as fully_shard requires
    (check_shard_dims); dim 0 may be uneven."""
    shard_size = draw(shard_sizes)
    shape = draw(st.lists(st.integers(0, 9), min_size=1, max_size=3))
    dim = draw(st.integers(0, len(shape) - 1))
    if even and dim != 0:
        shape[dim] = shard_size * draw(st.integers(0, 3))
    return torch.Size(shape), dim, shard_size


def torch_chunks(whole: torch.Tensor, shard_size: int, dim: int) -> list[torch.Tensor]:
    """torch.chunk's pieces, one per rank: ranks past the last chunk get an empty one."""
    chunks = list(torch.chunk(whole, shard_size, dim))
    empty = whole.narrow(dim, whole.shape[dim], 0)
    return chunks + [empty] * (shard_size - len(chunks))


def mesh_for(rank: int, shape: tuple[int, ...]) -> DeviceMesh:
    """A mesh over range(prod(shape)) as seen from `rank`, with no process group behind it
    (DTensor's shape math asks the mesh only for the rank's coordinate)."""
    ranks = torch.arange(torch.Size(shape).numel()).view(shape)
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=rank)


@FAST
@given(dim0=st.integers(0, 40), shard_size=shard_sizes)
def test_chunk_range_is_torch_chunk(dim0, shard_size):
    rows = torch_chunks(torch.arange(dim0), shard_size, 0)
    ranges = [chunk_range(dim0, shard_size, rank) for rank in range(shard_size)]
    assert [list(r) for r in ranges] == [chunk.tolist() for chunk in rows]


@FAST
@given(dim0=st.integers(0, 40), shard_size=shard_sizes)
def test_chunk_range_is_dtensor_shard(dim0, shard_size):
    for rank in range(shard_size):
        rows = chunk_range(dim0, shard_size, rank)
        size, offset = Shard(0)._local_shard_size_and_offset(dim0, shard_size, rank)
        assert len(rows) == size
        if size:  # an empty shard's offset is unread, here and in torch
            assert rows.start == offset


@FAST
@given(layout_args=layouts(), replicas=st.integers(1, 3))
def test_local_shape_is_dtensors(layout_args, replicas):
    """On a 1-D mesh (Shard(dim)) and on an HSDP mesh (Replicate(), Shard(dim)): every rank's
    local shape and offset on `dim` are DTensor's."""
    shape, dim, shard_size = layout_args
    layout = shard_layout(shape, shard_size, dim)
    mesh_shape = (replicas, shard_size) if replicas > 1 else (shard_size,)
    placements = [Replicate()] * (len(mesh_shape) - 1) + [Shard(dim)]
    for rank in range(replicas * shard_size):
        local_shape, offset = compute_local_shape_and_global_offset(
            shape, mesh_for(rank, mesh_shape), placements
        )
        shard_rank = rank % shard_size
        assert layout.local_shape(shard_rank) == torch.Size(local_shape)
        if local_shape[dim]:
            assert layout.chunk(shard_rank).start == offset[dim]


@FAST
@given(layout_args=layouts())
def test_padding_fits_every_shard_and_no_more(layout_args):
    shape, dim, shard_size = layout_args
    layout = shard_layout(shape, shard_size, dim)
    sizes = [len(layout.chunk(rank)) for rank in range(shard_size)]
    assert layout.padded_rows == max(sizes)  # the largest shard: no padding there
    assert sum(sizes) == shape[dim]
    assert sum(layout.local_shape(rank).numel() for rank in range(shard_size)) == layout.numel
    assert layout.padded_shard_numel == layout.padded_rows * layout.row_numel
    assert layout.row_numel * shape[dim] == layout.numel
    # Shards are torch.chunk's: full ones first, then at most one partial, then empty ones.
    assert sizes == sorted(sizes, reverse=True)
    assert sum(0 < size < layout.padded_rows for size in sizes) <= 1


def padded_shards(whole: torch.Tensor, shard_size: int, dim: int) -> torch.Tensor:
    """What an all-gather of every rank's padded shard returns: row r is rank r's shard,
    flat and contiguous, then padding (-1: a value the parameter never holds)."""
    layout = shard_layout(whole.shape, shard_size, dim)
    gathered = whole.new_full((shard_size, layout.padded_shard_numel), -1)
    for rank, chunk in enumerate(torch_chunks(whole, shard_size, dim)):
        gathered[rank, : chunk.numel()] = chunk.reshape(-1)
    return gathered


@FAST
@given(layout_args=layouts(even=True))
def test_copy_out_of_the_gathered_rows_is_the_parameter(layout_args):
    """The unsharded buffer (shard_size * padded_shard_numel), written through rank_rows as
    the copy-out does, holds the parameter followed by padding."""
    shape, dim, shard_size = layout_args
    layout = shard_layout(shape, shard_size, dim)
    whole = torch.arange(layout.numel, dtype=torch.float32).view(shape)
    buffer = torch.full((shard_size * layout.padded_shard_numel,), float("nan"))
    target = layout.rank_rows(buffer)
    assert target.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view
    target.copy_(padded_shards(whole, shard_size, dim).view(target.shape))
    assert torch.equal(buffer[: layout.numel].view(shape), whole)


@FAST
@given(layout_args=layouts(even=True))
def test_rank_first_puts_each_ranks_shard_on_dim_0(layout_args):
    """rank_first (what the reduce-scatter's input and the copy-out go through) is a view
    whose index r on dim 0 is rank r's shard, as torch.chunk cuts it on `dim`."""
    shape, dim, shard_size = layout_args
    layout = shard_layout(shape, shard_size, dim)
    whole = torch.arange(layout.numel, dtype=torch.float32).view(shape)
    split = layout.rank_first(whole)
    assert split.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    if dim == 0:
        assert split is whole  # dim 0 needs no view: ranks' rows are consecutive already
        return
    for rank, chunk in enumerate(torch_chunks(whole, shard_size, dim)):
        assert torch.equal(split[rank], chunk)


def post_forward_param(whole: torch.Tensor, shard_size: int, dim: int) -> SimpleNamespace:
    """What PostForwardShards reads of a ShardedParam: its layout over the full shard group,
    its unsharded tensor and its flat unsharded buffer (shard_size * padded_shard_numel)."""
    layout = shard_layout(whole.shape, shard_size, dim)
    buffer = torch.zeros(shard_size * layout.padded_shard_numel, dtype=whole.dtype)
    return SimpleNamespace(layout=layout, unsharded=whole, unsharded_buffer=buffer)


def post_forward_mesh(group_size: int, index: int) -> SimpleNamespace:
    """What PostForwardShards reads of its mesh: dim 1, the group, and this rank in it."""
    return SimpleNamespace(
        get_group=lambda dim: None, size=lambda dim: group_size, get_local_rank=lambda dim: index
    )


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
ParamSpec = tuple[torch.Size, int, torch.dtype]  # shape, shard dim, dtype


@st.composite
def post_forward_cases(draw: st.DrawFn) -> tuple[int, int, list[ParamSpec]]:
    """(shard_size, group_size dividing it, a unit's parameters)."""
    shard_size = draw(shard_sizes)
    divisors = [k for k in range(1, shard_size + 1) if shard_size % k == 0]
    group_size = draw(st.sampled_from(divisors))
    params = []
    for _ in range(draw(st.integers(1, 3))):
        shape, dim, _ = draw(layouts())
        if dim != 0:  # evenly split over the full group, so over any group dividing it
            sizes = list(shape)
            sizes[dim] = shard_size * draw(st.integers(0, 2))
            shape = torch.Size(sizes)
        params.append((shape, dim, draw(st.sampled_from(DTYPES))))
    return shard_size, group_size, params


@FAST
@given(case=post_forward_cases())
def test_post_forward_pieces_gather_back_to_the_parameters(case):
    """reshard_after_forward=<group_size>: each group rank keeps torch.chunk's piece over the
    group (padded; as bytes when the dtypes differ); gathering the group's pieces and
    copying them out rebuilds every parameter in its unsharded buffer, which is the full
    group's size and so holds the smaller group's padded layout too."""
    shard_size, group_size, specs = case
    wholes = [
        torch.arange(shape.numel(), dtype=torch.float64).view(shape).to(dtype)
        for shape, _, dtype in specs
    ]
    params = [post_forward_param(w, shard_size, dim) for w, (_, dim, _) in zip(wholes, specs)]
    rows, shards = [], None
    for index in range(group_size):
        shards = PostForwardShards(params, post_forward_mesh(group_size, index))
        shards.keep()
        pieces = shards.take()
        assert shards.sizes == [piece.numel() for piece in pieces]  # the same on every rank
        for piece, whole, (shape, dim, _) in zip(pieces, wholes, specs):
            chunk = torch_chunks(whole, group_size, dim)[index]
            data = piece.view(whole.dtype) if shards.as_bytes else piece
            assert torch.equal(data[: chunk.numel()], chunk.reshape(-1))
            # The piece is DTensor's local shard of Shard(dim) over the group.
            local_shape, offset = compute_local_shape_and_global_offset(
                shape, mesh_for(index, (group_size,)), [Shard(dim)]
            )
            assert chunk.shape == torch.Size(local_shape)
            if local_shape[dim]:
                assert torch.equal(chunk, whole.narrow(dim, offset[dim], local_shape[dim]))
        rows.append(torch.cat(pieces))
    assert shards is not None
    for param, (shape, dim, _) in zip(params, specs):
        small = shard_layout(shape, group_size, dim)
        assert group_size * small.padded_shard_numel <= param.unsharded_buffer.numel()
    shards.copy_out(torch.stack(rows), all_dim0=all(dim == 0 for _, dim, _ in specs))
    for param, whole in zip(params, wholes):
        assert torch.equal(param.unsharded_buffer[: whole.numel()].view(whole.shape), whole)
