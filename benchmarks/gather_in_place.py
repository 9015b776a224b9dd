"""The measurements behind the in-place gather rule (docs/design.md, "Gathering in place"):
one unit of a transformer block's 12 parameters, unsharded and reduced the two ways the
design allows, on the backend it runs.

    torchrun --nproc_per_node=2 benchmarks/gather_in_place.py    # gloo ranks, then fake W=8

Gathers: one flat all-gather of the unit's shards and a copy-out into each parameter's
unsharded data (`split_with_sizes_copy`), against one coalesced all-gather with each
parameter's unsharded data as its own output (nothing copied). Reductions: the gradients
chunked into one flat input (`_chunk_cat`) and one reduce-scatter, against one coalesced
reduce-scatter of the gradients as they are; their results must be bit-identical. Each is
timed alone, interleaved in rounds, median over rounds; at several widths, on the gloo
ranks and on a fake group of 8 (where nothing is sent: the runtime's side alone). Rank 0
writes gather_in_place.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import provenance
from torch.distributed import ProcessGroup
from torch.testing._internal.distributed.fake_pg import FakeStore

SUM = dist.ReduceScatterOptions()
SUM.reduceOp = dist.ReduceOp.SUM


def block_shapes(dim: int) -> list[tuple[int, ...]]:
    """A pre-norm transformer block's 12 parameters (norms, qkv, projection, MLP)."""
    return [(dim,), (dim,), (3 * dim, dim), (3 * dim,), (dim, dim), (dim,),
            (dim,), (dim,), (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]


def contenders(group: ProcessGroup, dim: int) -> dict[str, Callable[[], None]]:
    world = group.size()
    shapes = block_shapes(dim)
    sizes = [-(-s[0] // world) * torch.Size(s[1:]).numel() for s in shapes]  # padded shards
    flat = torch.randn(sum(sizes))
    shards = list(flat.split(sizes))
    gathered = torch.empty(world, sum(sizes))
    unsharded = [torch.empty(world * n) for n in sizes]
    rows = [u.view(world, n) for u, n in zip(unsharded, sizes)]
    grads = [torch.randn(world * n) for n in sizes]  # padded: chunks as the shards
    chunked, reduced = torch.empty(world, sum(sizes)), torch.empty(sum(sizes))
    reduced_each = [torch.empty(n) for n in sizes]

    def flat_gather() -> None:
        group.allgather_into_tensor_coalesced([gathered.view(-1)], [flat]).wait()
        torch.split_with_sizes_copy(gathered, sizes, dim=1, out=rows)

    def gather_in_place() -> None:
        group.allgather_into_tensor_coalesced(unsharded, shards).wait()

    def flat_reduce() -> None:
        torch._chunk_cat(grads, dim=0, num_chunks=world, out=chunked)
        group.reduce_scatter_tensor_coalesced([reduced], [chunked.view(-1)], SUM).wait()

    def reduce_each() -> None:
        group.reduce_scatter_tensor_coalesced(reduced_each, grads, SUM).wait()

    flat_reduce(), reduce_each()
    if not all(torch.equal(a, b) for a, b in zip(reduced.split(sizes), reduced_each)):
        raise AssertionError(f"dim {dim}: per-parameter reduce-scatters differ from one flat one")
    return {"flat all-gather + copy-out": flat_gather, "in place": gather_in_place,
            "_chunk_cat + flat reduce-scatter": flat_reduce, "per-parameter reduce-scatters": reduce_each}


def timed(group: ProcessGroup, dim: int, rounds: int, calls: int) -> dict[str, float]:
    """µs per call of each contender, median over interleaved rounds."""
    runs = contenders(group, dim)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            group.barrier().wait() if group.size() > 1 and dist.get_backend(group) != "fake" else None
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {"gloo": {str(d): timed(dist.group.WORLD, d, args.rounds, args.calls) for d in args.dims}}
    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    results["fake"] = {str(d): timed(dist.group.WORLD, d, args.rounds, args.calls) for d in args.dims}
    dist.destroy_process_group()
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        result = {"config": {**vars(args), "world_size": world, "out": str(args.out),
                             **provenance(torch.device("cpu"))}, "us_per_call": results}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gather_in_place.json").write_text(json.dumps(result, indent=2))
        for backend, by_dim in results.items():
            for dim, row in by_dim.items():
                print(backend, dim, {k: round(v, 1) for k, v in row.items()})


if __name__ == "__main__":
    main()
