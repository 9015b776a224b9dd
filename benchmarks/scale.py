"""The same model at 8 … 1024 ranks, one rank of each simulated in one process on the fake
process group (the values are not a real job's; the shapes, sizes and allocations are): per-rank
peak memory, bytes per step and step time of fsdp_compose and FSDP2, against the analytic figures.

    python benchmarks/scale.py                               # W = 8, 64, 256, 1024
    python benchmarks/scale.py --worlds 16 4096 --rank 4095  # another rank, other sizes
"""

from __future__ import annotations

import statistics
import time

import harness
import report
import step
import torch

CPU, SHARDED = torch.device("cpu"), report.SHARDED


def at_world(args, world: int) -> dict:
    """The contenders on a fake W-rank group, warmed up (AdamW's state), measured."""
    with harness.process_group("fake", world, args.rank):
        models = {name: step.build(name, args, CPU) for name in (*SHARDED, "floor")}
        optims = {name: torch.optim.AdamW(m.parameters(), lr=step.LR) for name, m in models.items()}
        tokens = step.batch(args, 0, CPU)
        runs = {name: (lambda m=models[name], o=optims[name]: step.train_step(m, o, tokens))
                for name in SHARDED}
        times = harness.interleaved(runs, args.steps, warmup=1)  # the first: AdamW's state
        communication = {}
        for name, run in runs.items():
            with step.Counter(models[name]) as counter:
                run()
            communication[name] = counter.sent
        memory = {name: step.measure_memory(models[name], optims[name], tokens) for name in models}
        floor = step.analytic(args, models["floor"], memory["floor"])
        del models, optims, runs
    return {"world_size": world,
            "step_seconds": {name: statistics.median(t) for name, t in times.items()},
            "step_samples": times, "communication": communication, "peak_memory": memory,
            "analytic": floor}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--rank", type=int, default=0, help="the rank simulated")
    step.add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per runtime")
    args = parser.parse_args()
    if any(not 0 <= args.rank < world for world in args.worlds):
        parser.error(f"--rank {args.rank} is not a rank of every world size in {args.worlds}")
    torch.set_num_threads(1)  # one rank's share of a machine
    started = time.perf_counter()
    with torch.device("meta"):  # past this many ranks, no parameter's shard shrinks
        largest_rows = max(p.shape[0] for p in step.make_model(args).parameters())
    config = harness.config(args, CPU, device=str(CPU), backend="fake", largest_rows=largest_rows)
    worlds = [at_world(args, world) for world in args.worlds]
    harness.write(args.out, "scale", {"config": config, "worlds": worlds}, started)
    print(report.scale_table(worlds))
    print("bytes are each collective's buffer; a ring sends (W-1)/W of it per rank")


if __name__ == "__main__":
    main()
