"""CPU overhead per unit of fsdp_compose and torch's fully_shard, in one process.

    python benchmarks/overhead.py                # W=8 fake ranks, 64 Linear(64, 64) units
    python benchmarks/overhead.py --backend gloo # one real gloo rank: no communication
    python benchmarks/overhead.py --block transformer --optimizer
                                                 # 16 transformer blocks, AdamW in each step

With the fake process group nothing is sent, so a training step's time minus the same model's
unsharded step, divided by the number of units, is CPU time per unit per forward + backward
(+ a foreach AdamW step over every contender's parameters with --optimizer, the unsharded
model's included, so that what remains is what sharding adds to it). Part of it is the fake
group's own: it still copies every rank's shard into the gathered output. Further rounds time
the calls into the process group and report what remains as the runtime's own. Beside the
runtimes: a second fsdp_compose model that ran one step under a StepTrace first (what a closed
trace leaves behind), and a unit's work done by hand with nothing else (handwritten.py: about
the least a runtime of this design can cost; its gradients are checked against fsdp_compose's
first). A unit is a Linear or GPT-2's transformer block of 12 parameters (--block), whose
per-parameter costs a Linear's two hide.

Each run goes into overhead.json under the backend's name (with the block and optimizer
appended unless they are the defaults), beside other runs' results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

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

# Per block, the defaults of --units and --batch: the transformer's blocks cost more to
# compute, and compute's noise is subtracted with the unsharded step's.
DEFAULTS = {"linear": {"units": 64, "batch": 8}, "transformer": {"units": 16, "batch": 4}}
# Each contender's runtime: None, unsharded; "FSDP2", torch's fully_shard.
RUNTIMES = {"unsharded": None, "torch fully_shard": "FSDP2", "fsdp_compose": "fsdp_compose",
            "after a StepTrace": "fsdp_compose", "by hand": "by hand"}


def build(args: argparse.Namespace, runtime: str | None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.dim, args.dim) if args.block == "linear"
                            else Block(args.dim) for _ in range(args.units)))
    if runtime == "by hand":
        shard_by_hand(model)
    elif runtime is not None:
        harness.shard(model, model, runtime, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


class Contender:
    """A model and, with --optimizer, its AdamW (foreach, as on accelerators by default)."""

    def __init__(self, args: argparse.Namespace, runtime: str | None) -> None:
        self.model = build(args, runtime)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True) \
            if args.optimizer else None

    def steps(self, x: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            self.model(x).sum().backward()
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad()


class CollectiveClock:
    """While installed, the seconds and calls spent inside the process group's all-gathers
    and reduce-scatters (the runtimes call one of these per unit and pass)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._originals = {name: getattr(ProcessGroup, name)
                           for name in (ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD)}

    def __enter__(self) -> CollectiveClock:
        for name, original in self._originals.items():
            setattr(ProcessGroup, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(ProcessGroup, name, original)

    def _timed(self, original: Callable) -> Callable:
        def timed(*args: object) -> object:
            start = time.perf_counter()
            try:
                return original(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def check_by_hand(args: argparse.Namespace, x: torch.Tensor) -> None:
    """The hand-written units compute fsdp_compose's gradient shards, to the last bit."""
    ours, by_hand = build(args, "fsdp_compose"), build(args, "by hand")
    for model in (ours, by_hand):
        for _ in range(2):  # the second adds to the first's .grad
            model(x).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), by_hand.parameters(), strict=True):
        if not torch.equal(p.grad.to_local(), q.grad):
            raise AssertionError(f"the hand-written units' gradient of {name} is not ours")


def fake_group_reduces() -> bool:
    """Whether the fake group's reduce-scatter writes its output, as it does from torch 2.13
    on. Before, it leaves the output as it was: gradients hold whatever memory held."""
    output = torch.full((1,), -1.0)
    # The group's own method, as the runtimes call it (dist's wrapper is deprecated on 2.13).
    zeros = torch.zeros(dist.get_world_size())
    getattr(dist.group.WORLD, REDUCE_SCATTER_METHOD)(
        output, zeros, dist.ReduceScatterOptions()).wait()
    return output.item() == 0.0


def measure(args: argparse.Namespace, x: torch.Tensor) -> dict[str, dict]:
    """Each contender's step time per round, and, in rounds apart (the clock's own cost stays
    out of the step times), the time and calls inside the collectives: the JSON's variants."""
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
            with CollectiveClock() as clock:
                run()
            inside[name].append(clock.seconds / args.steps)
            calls[name] = clock.calls / args.steps / args.units
    floor = statistics.median(times["unsharded"])
    variants = {}
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


def show(args: argparse.Namespace, variants: dict[str, dict]) -> None:
    """Each contender's figures, and its ratio to FSDP2 (tests/test_benchmarks.py reads the
    rows)."""
    unit = f"Linear({args.dim}, {args.dim})" if args.block == "linear" else \
        f"transformer block (dim {args.dim}, seq {args.seq}, 12 parameters)"
    print(f"torch {torch.__version__}  {args.backend}  world={dist.get_world_size()}  "
          f"{args.units} x {unit}  batch {args.batch}{'  + AdamW' if args.optimizer else ''}  "
          f"median of {args.repeats}")
    print(f"{'variant':<20}{'step ms':>10}{'us / unit':>12}{'collectives':>14}{'runtime':>10}"
          f"{'calls / unit':>14}")
    for name, v in variants.items():
        print(f"{name:<20}{v['step_seconds'] * 1e3:>10.2f}{v['us_per_unit']:>12.1f}"
              f"{v['collectives_us_per_unit']:>14.1f}{v['runtime_us_per_unit']:>10.1f}"
              f"{v['calls_per_unit']:>14.2f}")
    print("per unit, against torch fully_shard: " + ", ".join(
        f"{name} {variants[name]['vs_fsdp2']:.3f}"
        for name in ("fsdp_compose", "after a StepTrace", "by hand")))


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
    # Not options: the reference setting the CPU-overhead goal is read against (report.py).
    args.dim, args.seq, args.batch = 64, 16, DEFAULTS[args.block]["batch"]
    key = args.backend if args.block == "linear" and not args.optimizer else \
        f"{args.backend}, {args.block}" + (" + AdamW" if args.optimizer else "")
    config = harness.config(args)
    started = time.perf_counter()
    with harness.process_group(args.backend, 8 if args.backend == "fake" else 1):
        torch.set_num_threads(1)
        shape = (args.batch, args.dim) if args.block == "linear" else \
            (args.batch, args.seq, args.dim)
        x = torch.randn(shape)
        if args.backend == "gloo" or fake_group_reduces():
            check_by_hand(args, x)
        else:
            print("(the work by hand is not checked: this torch's fake group reduces nothing)")
        variants = measure(args, x)
        show(args, variants)
        config["world_size"] = dist.get_world_size()
    config["wall_seconds"] = time.perf_counter() - started
    path = args.out / "overhead.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = {"config": config, "variants": variants}  # beside other runs'
    harness.write(args.out, "overhead", results)


if __name__ == "__main__":
    main()
