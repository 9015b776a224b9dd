"""CPU overhead per unit of fsdp_compose and torch's fully_shard, in one process: a step's
time minus the unsharded model's, per unit, and the part inside the process group's calls.

    python benchmarks/overhead.py                # W=8 fake ranks, 64 Linear(64, 64) units
    python benchmarks/overhead.py --backend gloo # one real gloo rank: no communication
    python benchmarks/overhead.py --block transformer --optimizer
                                                 # 16 transformer blocks, AdamW in each step
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import harness
import torch
import torch.distributed as dist
from handwritten import shard_by_hand
from models import Block
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import StepTrace
from fsdp_compose.comm.compat import ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD

# Per block, the defaults of --units and --batch: transformer blocks cost more to compute, and
# compute's noise is subtracted with the unsharded step's.
DEFAULTS = {"linear": {"units": 64, "batch": 8}, "transformer": {"units": 16, "batch": 4}}
RUNTIMES = {"unsharded": None, "torch fully_shard": "FSDP2", "fsdp_compose": "fsdp_compose",
            "after a StepTrace": "fsdp_compose", "by hand": "by hand"}


class Contender:
    """A model and, with --optimizer, its AdamW (foreach, as on accelerators by default)."""

    def __init__(self, args: argparse.Namespace, runtime: str | None) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(*(nn.Linear(args.dim, args.dim) if args.block == "linear"
                                     else Block(args.dim) for _ in range(args.units)))
        if runtime == "by hand":
            shard_by_hand(self.model)
        elif runtime is not None:
            harness.shard(self.model, self.model, runtime,
                          mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True) \
            if args.optimizer else None

    def steps(self, x: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            self.model(x).sum().backward()
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad()


@contextmanager
def collective_clock():
    """[seconds, calls] inside the process group's all-gathers and reduce-scatters."""
    clock, originals = [0.0, 0], {name: getattr(ProcessGroup, name)
                                  for name in (ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD)}

    def timed(original):
        def call(*args):
            start = time.perf_counter()
            try:
                return original(*args)
            finally:
                clock[0] += time.perf_counter() - start
                clock[1] += 1
        return call

    for name, original in originals.items():
        setattr(ProcessGroup, name, timed(original))
    try:
        yield clock
    finally:
        for name, original in originals.items():
            setattr(ProcessGroup, name, original)


def check_by_hand(args: argparse.Namespace, x: torch.Tensor) -> None:
    """The hand-written units compute fsdp_compose's gradient shards, to the last bit. Only
    where the fake group's reduce-scatter writes its output (from torch 2.13; before, the
    gradients hold whatever memory held)."""
    if args.backend == "fake":
        output = torch.full((1,), -1.0)
        getattr(dist.group.WORLD, REDUCE_SCATTER_METHOD)(  # as the runtimes call it
            output, torch.zeros(dist.get_world_size()), dist.ReduceScatterOptions()).wait()
        if output.item() != 0.0:
            print("(the work by hand is not checked: this torch's fake group reduces nothing)")
            return
    ours, by_hand = Contender(args, "fsdp_compose").model, Contender(args, "by hand").model
    for model in (ours, by_hand):
        for _ in range(2):  # the second adds to the first's .grad
            model(x).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), by_hand.parameters(), strict=True):
        if not torch.equal(p.grad.to_local(), q.grad):
            raise AssertionError(f"the hand-written units' gradient of {name} is not ours")


def measure(args: argparse.Namespace, x: torch.Tensor) -> dict[str, dict]:
    """Each contender's step time per round, and in rounds apart (the clock's cost stays out
    of the step times) the time and calls inside the collectives."""
    contenders = {name: Contender(args, runtime) for name, runtime in RUNTIMES.items()}
    for contender in contenders.values():
        contender.steps(x, 3)  # warm up: lazy init, allocator, optimizer state
    with StepTrace(contenders["after a StepTrace"].model):
        contenders["after a StepTrace"].steps(x, 1)
    runs = {name: (lambda c=c: c.steps(x, args.steps)) for name, c in contenders.items()}
    times = {name: [t / args.steps for t in samples]
             for name, samples in harness.interleaved(runs, args.repeats).items()}
    inside: dict[str, list[float]] = {name: [] for name in contenders}
    calls: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, run in runs.items():
            with collective_clock() as clock:
                run()
            inside[name].append(clock[0] / args.steps)
            calls[name] = clock[1] / args.steps / args.units
    floor, variants = statistics.median(times["unsharded"]), {}
    for name, samples in times.items():
        per_unit = (statistics.median(samples) - floor) / args.units * 1e6
        in_collectives = statistics.median(inside[name]) / args.units * 1e6
        variants[name] = {
            "step_seconds": statistics.median(samples), "step_samples": samples,
            "us_per_unit": per_unit, "collectives_us_per_unit": in_collectives,
            "runtime_us_per_unit": per_unit - in_collectives, "collective_samples": inside[name],
            "calls_per_unit": calls[name]}
    for variant in variants.values():
        variant["vs_fsdp2"] = variant["us_per_unit"] / variants["torch fully_shard"]["us_per_unit"]
    return variants


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--backend", choices=("fake", "gloo"), default="fake")
    parser.add_argument("--block", choices=tuple(DEFAULTS), default="linear",
                        help="what a unit is")
    parser.add_argument("--optimizer", action="store_true", help="an AdamW step in every step")
    parser.add_argument("--units", type=int, help="64 Linear, 16 transformer blocks")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    args.units = args.units or DEFAULTS[args.block]["units"]
    # Not options: the setting the CPU-overhead goal is read against (report.py).
    args.dim, args.seq, args.batch = 64, 16, DEFAULTS[args.block]["batch"]
    key = args.backend if args.block == "linear" and not args.optimizer else \
        f"{args.backend}, {args.block}" + (" + AdamW" if args.optimizer else "")
    config, started = harness.config(args), time.perf_counter()
    with harness.process_group(args.backend, 8 if args.backend == "fake" else 1):
        torch.set_num_threads(1)
        x = torch.randn((args.batch, args.dim) if args.block == "linear" else
                        (args.batch, args.seq, args.dim))
        check_by_hand(args, x)
        variants = measure(args, x)
        config["world_size"] = dist.get_world_size()
    unit = f"Linear({args.dim}, {args.dim})" if args.block == "linear" else \
        f"transformer block (dim {args.dim}, seq {args.seq}, 12 parameters)"
    print(f"torch {torch.__version__}  {args.backend}  world={config['world_size']}  "
          f"{args.units} x {unit}  batch {args.batch}{'  + AdamW' if args.optimizer else ''}  "
          f"median of {args.repeats}\n{'variant':<20}{'step ms':>10}{'us / unit':>12}"
          f"{'collectives':>14}{'runtime':>10}{'calls / unit':>14}")  # tests read the rows
    for name, v in variants.items():
        print(f"{name:<20}{v['step_seconds'] * 1e3:>10.2f}{v['us_per_unit']:>12.1f}"
              f"{v['collectives_us_per_unit']:>14.1f}{v['runtime_us_per_unit']:>10.1f}"
              f"{v['calls_per_unit']:>14.2f}")
    print("per unit, against torch fully_shard: " + ", ".join(
        f"{name} {variants[name]['vs_fsdp2']:.3f}" for name in list(RUNTIMES)[2:]))
    config["wall_seconds"] = time.perf_counter() - started
    path = args.out / "overhead.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = {"config": config, "variants": variants}  # beside other runs'
    harness.write(args.out, "overhead", results)


if __name__ == "__main__":
    main()
