"""The same model at 8 … 1024 ranks, in one process: per-rank peak memory and bytes per
step of fsdp_compose and torch's fully_shard (FSDP2), next to the analytic figures.

    python benchmarks/scale.py                               # W = 8, 64, 256, 1024
    python benchmarks/scale.py --worlds 16 4096 --rank 4095  # another rank, other sizes

Each world size runs one rank of a W-rank job on the fake process group: the values are not
a real job's, the shapes, sizes and allocations are. The model is benchmarks/step.py's,
trained with AdamW. Per world size: peak tracked memory per rank against the analytic bound,
collectives and bytes per step against the analytic floor, and the CPU time of a step (no data
moves between ranks: this is the per-rank cost of the runtime and of filling the buffers).
Every parameter is padded to W shards on dim 0, so once W outgrows a dimension the shards stop
shrinking: the analytic figures count that padding, as both runtimes allocate it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness
import report
import torch
from measures import CollectiveCounter, analytic
from step import LR, add_model_arguments, batch, build, make_model, measure_memory, train_step

CPU = torch.device("cpu")
SHARDED = ("fsdp_compose", "FSDP2")


def at_world(args: argparse.Namespace, world: int) -> dict:
    """Build the contenders on a fake W-rank group, warm them up (AdamW state), and measure."""
    with harness.process_group("fake", world, args.rank):
        models = {name: build(name, args, CPU) for name in (*SHARDED, "floor")}
        optims = {name: torch.optim.AdamW(m.parameters(), lr=LR) for name, m in models.items()}
        tokens = batch(args, 0, CPU)
        steps = {name: (lambda m=models[name], o=optims[name]: train_step(m, o, tokens))
                 for name in SHARDED}
        times = harness.interleaved(steps, args.steps, warmup=1)  # the first: AdamW's state
        communication = {}
        for name, step in steps.items():
            with CollectiveCounter() as counter:
                step()
            communication[name] = {"calls": counter.calls, "bytes": counter.bytes}
        memory = {name: measure_memory(models[name], optims[name], tokens) for name in models}
        floor = analytic(args, models["floor"], memory["floor"])
        del models, optims, steps
    return {"world_size": world,
            "step_seconds": {name: statistics.median(t) for name, t in times.items()},
            "step_samples": times, "communication": communication, "peak_memory": memory,
            "analytic": floor}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--rank", type=int, default=0, help="the rank simulated")
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per runtime")
    args = parser.parse_args()
    if any(not 0 <= args.rank < world for world in args.worlds):
        parser.error(f"--rank {args.rank} is not a rank of every world size in {args.worlds}")
    torch.set_num_threads(1)  # one rank's share of a machine
    started = time.perf_counter()
    with torch.device("meta"):  # past this many ranks, no parameter's shard shrinks
        largest_rows = max(p.shape[0] for p in make_model(args).parameters())
    config = harness.config(args, CPU, device=str(CPU), backend="fake", largest_rows=largest_rows)
    worlds = [at_world(args, world) for world in args.worlds]
    harness.write(args.out, "scale", {"config": config, "worlds": worlds}, started)
    print(report.scale_table(worlds))
    print("bytes are each collective's buffer; a ring sends (W-1)/W of it per rank")


if __name__ == "__main__":
    main()
