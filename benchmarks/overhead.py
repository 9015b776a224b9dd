"""CPU overhead per unit of fsdp_compose and torch's fully_shard, in one process.

    python benchmarks/overhead.py                # W=8 fake ranks, 64 Linear(64, 64) units
    python benchmarks/overhead.py --backend gloo # one real gloo rank: no communication

With the fake process group nothing is sent, so a training step's time minus the same
model's unsharded step, divided by the number of units, is CPU time per unit per forward +
backward. Part of it is the fake group's own: it still copies every rank's shard into the
gathered output and chunks the reduce-scatter's input. A second fsdp_compose model ran one
step under a StepTrace before timing (what a closed trace leaves behind). One more contender
does a unit's work by hand with nothing else (benchmarks/handwritten.py): the design's own
cost, about the least a runtime of this design can cost; its gradients are checked against
fsdp_compose's first. Further rounds time the calls into the process group, for every
contender, and report what remains as the runtime's own. On a one-rank gloo group the
runtimes skip communication altogether. The contenders run interleaved, in one process.

Each backend's results go to overhead.json in --out under the backend's name, next to the
other backend's from an earlier run, with the machine, versions and date
(benchmarks/report.py turns them into docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from handwritten import shard_by_hand
from provenance import provenance
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compose import StepTrace, fully_shard
from fsdp_compose.comm.compat import ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD


def build(units: int, dim: int, shard) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(units)))
    if shard is shard_by_hand:
        shard(model)
    elif shard is not None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
    return model


def step_seconds(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        model(x).sum().backward()
    return (time.perf_counter() - start) / steps


class CollectiveClock:
    """While installed, the seconds and calls spent inside the process group's all-gathers
    and reduce-scatters (the runtimes call one of these per unit and pass; fsdp_compose
    gathers in place with the coalesced one: see unit/layout.py's InPlaceGather)."""

    # Their names on this torch.
    _METHODS = (ALL_GATHER_METHOD, "allgather_into_tensor_coalesced", REDUCE_SCATTER_METHOD)

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._originals = {name: getattr(ProcessGroup, name) for name in self._METHODS}

    def __enter__(self) -> CollectiveClock:
        for name, original in self._originals.items():
            setattr(ProcessGroup, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(ProcessGroup, name, original)

    def _timed(self, original):
        def timed(*args):
            start = time.perf_counter()
            try:
                return original(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def check_by_hand(units: int, dim: int, x: torch.Tensor) -> None:
    """The hand-written units compute fsdp_compose's gradient shards, to the last bit."""
    ours, by_hand = build(units, dim, fully_shard), build(units, dim, shard_by_hand)
    for model in (ours, by_hand):
        for _ in range(2):  # the second adds to the first's .grad
            model(x).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), by_hand.parameters()):
        if not torch.equal(p.grad.to_local(), q.grad):
            raise AssertionError(f"the hand-written units' gradient of {name} is not fsdp_compose's")


def fake_group_reduces() -> bool:
    """Whether the fake group's reduce-scatter writes its output (this rank's block of the
    input), as it does from torch 2.13 on. Before, it leaves the output as it was, so every
    runtime's gradients hold whatever memory held and there is nothing to compare."""
    output = torch.full((1,), -1.0)
    dist.reduce_scatter_tensor(output, torch.zeros(dist.get_world_size()))
    return output.item() == 0.0


def collective_seconds(model: nn.Module, x: torch.Tensor, steps: int) -> tuple[float, float]:
    """Per step: seconds inside the process group's collectives, and how many calls."""
    with CollectiveClock() as clock:
        step_seconds(model, x, steps)
    return clock.seconds / steps, clock.calls / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("fake", "gloo"), default="fake")
    parser.add_argument("--world", type=int, default=8, help="ranks simulated (fake backend)")
    parser.add_argument("--units", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    config = {**vars(args), **provenance()}
    start = time.perf_counter()
    if args.backend == "fake":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.dim)
    models = {
        "unsharded": build(args.units, args.dim, None),
        "torch fully_shard": build(args.units, args.dim, torch_fully_shard),
        "fsdp_compose": build(args.units, args.dim, fully_shard),
        # What a StepTrace, opened and closed, leaves behind.
        "after a StepTrace": build(args.units, args.dim, fully_shard),
        "by hand": build(args.units, args.dim, shard_by_hand),
    }
    if args.backend == "gloo" or fake_group_reduces():
        check_by_hand(args.units, args.dim, x)
    else:
        print("(the work by hand is not checked: this torch's fake group reduces nothing)")
    for model in models.values():
        step_seconds(model, x, 3)  # warm up: lazy init, allocator
    with StepTrace(models["after a StepTrace"]):
        step_seconds(models["after a StepTrace"], x, 1)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):  # interleaved, so drift hits every contender alike
        for name, model in models.items():
            times[name].append(step_seconds(model, x, args.steps))
    inside: dict[str, list[float]] = {name: [] for name in models}
    calls: dict[str, float] = {}
    for _ in range(args.repeats):  # apart: the clock's own cost stays out of the step times
        for name, model in models.items():
            seconds, calls[name] = collective_seconds(model, x, args.steps)
            inside[name].append(seconds)
    floor = statistics.median(times["unsharded"])
    print(f"torch {torch.__version__}  {args.backend}  world={dist.get_world_size()}  {args.units} x "
          f"Linear({args.dim}, {args.dim})  batch {args.batch}  median of {args.repeats}")
    print(f"{'variant':<20}{'step ms':>10}{'us / unit':>12}{'collectives':>14}{'runtime':>10}"
          f"{'calls / unit':>14}")
    variants = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        per_unit = (median - floor) / args.units * 1e6
        in_collectives = statistics.median(inside[name]) / args.units * 1e6
        print(f"{name:<20}{median * 1e3:>10.2f}{per_unit:>12.1f}{in_collectives:>14.1f}"
              f"{per_unit - in_collectives:>10.1f}{calls[name] / args.units:>14.2f}")
        variants[name] = {
            "step_seconds": median, "step_samples": samples, "us_per_unit": per_unit,
            "collectives_us_per_unit": in_collectives, "runtime_us_per_unit": per_unit - in_collectives,
            "collective_samples": inside[name], "calls_per_unit": calls[name] / args.units,
        }
    config["world_size"] = dist.get_world_size()
    config["wall_seconds"] = time.perf_counter() - start
    write(args.out, args.backend, {"config": config, "variants": variants})
    dist.destroy_process_group()


def write(out: Path, backend: str, result: dict) -> None:
    """Into out/overhead.json under `backend`, keeping the other backend's results."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "overhead.json"
    results = {}
    if path.exists():
        try:
            results = json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
        if not isinstance(results, dict):
            results = {}
    results[backend] = result
    path.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
