"""The same model at 8 … 1024 ranks, in one process: per-rank peak memory and bytes per
step of fsdp_compose and torch's fully_shard (FSDP2), next to the analytic figures.

    python benchmarks/scale.py                               # W = 8, 64, 256, 1024
    python benchmarks/scale.py --worlds 16 4096 --rank 4095  # another rank, other sizes

Each world size runs one rank of a W-rank job on the fake process group, which fills the
collectives' outputs without other processes (the values are not a real job's, the
shapes, sizes and allocations are). The model is the GPT of benchmarks/step.py (one unit
per block plus the root), trained with AdamW. Per world size: peak tracked memory per rank
(torch's MemTracker) against the analytic bound, collectives and bytes per step (counted
at dispatch) against the analytic floor, and the CPU time of a step (no data moves between
ranks, so this is the per-rank cost of the runtime and of filling the buffers). Every
parameter is padded to W shards on dim 0, so once W outgrows a dimension the shards stop
shrinking: the analytic figures count that padding, as both runtimes allocate it. Writes
scale.json to --out, with the machine, versions and date (benchmarks/report.py turns it
into docs/performance.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import provenance
from step import (
    CollectiveCounter,
    add_model_arguments,
    analytic,
    batch,
    build,
    measure_memory,
    train_step,
)
from torch.testing._internal.distributed.fake_pg import FakeStore
from train_gpt import GPT  # on the path once step is imported

CPU = torch.device("cpu")
SHARDED = ("fsdp_compose", "FSDP2")


def at_world(args: argparse.Namespace, world: int) -> dict:
    """Build the contenders on a fake W-rank group, warm them up (AdamW state), and measure."""
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=world)
    try:
        models = {name: build(name, args, CPU) for name in (*SHARDED, "floor")}
        optims = {name: torch.optim.AdamW(m.parameters(), lr=args.lr) for name, m in models.items()}
        tokens = batch(args, 0, CPU)
        times: dict[str, list[float]] = {name: [] for name in SHARDED}
        for step in range(1 + args.steps):  # the first builds AdamW's state, untimed
            for name in SHARDED:  # interleaved: drift hits both alike
                start = time.perf_counter()
                train_step(models[name], optims[name], tokens)
                if step:
                    times[name].append(time.perf_counter() - start)
        seconds = {name: statistics.median(t) for name, t in times.items()}
        communication = {}
        for name in SHARDED:
            with CollectiveCounter() as counter:
                train_step(models[name], optims[name], tokens)
            communication[name] = {"calls": counter.calls, "bytes": counter.bytes}
        memory = {name: measure_memory(models[name], optims[name], tokens) for name in models}
        floor = analytic(args, models["floor"], memory["floor"])
        del models, optims
        gc.collect()  # meshes go before the process group
    finally:
        dist.destroy_process_group()
    return {"world_size": world, "step_seconds": seconds, "step_samples": times,
            "communication": communication, "peak_memory": memory, "analytic": floor}


def largest_rows(args: argparse.Namespace) -> int:
    """The model's largest dim 0: past that many ranks, no parameter's shard shrinks."""
    with torch.device("meta"):
        model = GPT(args.vocab, args.dim, args.heads, args.depth, args.seq)
    return max(p.shape[0] for p in model.parameters())


def report(config: dict, results: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps({"config": config, "worlds": results}, indent=1, default=str))
    print(f"{'W':>6}{'peak KiB':>10}{'FSDP2':>10}{'bound':>10}{'vs bound':>9}"
          f"{'gathered B':>12}{'reduced B':>11}{'floor?':>7}{'step ms':>9}{'FSDP2':>9}")
    for r in results:
        ours, theirs = (r["peak_memory"][n]["Total"] for n in SHARDED)
        floor = r["analytic"]
        bound = floor["memory_bound"]
        sent = r["communication"]["fsdp_compose"]["bytes"]
        at_floor = sent == {"all_gather": floor["all_gather_bytes"],
                            "reduce_scatter": floor["reduce_scatter_bytes"]}
        print(f"{r['world_size']:>6}{ours / 1024:10.0f}{theirs / 1024:10.0f}{bound / 1024:10.0f}"
              f"{ours / bound:9.2f}{sent['all_gather']:12}{sent['reduce_scatter']:11}"
              f"{'yes' if at_floor else 'NO':>7}"
              f"{r['step_seconds']['fsdp_compose'] * 1e3:9.1f}{r['step_seconds']['FSDP2'] * 1e3:9.1f}")
    print("bytes are each collective's buffer; a ring sends (W-1)/W of it per rank")
    print(f"wrote {out / 'scale.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--rank", type=int, default=0, help="the rank simulated")
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per runtime")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if any(not 0 <= args.rank < world for world in args.worlds):
        parser.error(f"--rank {args.rank} is not a rank of every world size in {args.worlds}")
    torch.set_num_threads(1)  # one rank's share of a machine
    start = time.perf_counter()
    config = {**vars(args), "device": str(CPU), "backend": "fake", **provenance(CPU),
              "largest_rows": largest_rows(args)}
    results = [at_world(args, world) for world in args.worlds]
    config["wall_seconds"] = time.perf_counter() - start
    report(config, results, args.out)


if __name__ == "__main__":
    main()
