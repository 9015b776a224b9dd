"""CPU overhead per unit of fsdp_compose and torch's fully_shard, in one process.

    python benchmarks/overhead.py                # W=8 fake ranks, 64 Linear(64, 64) units
    python benchmarks/overhead.py --backend gloo # one real gloo rank: no communication
    python benchmarks/overhead.py --block transformer --optimizer
                                                 # 16 transformer blocks, AdamW in each step

With the fake process group nothing is sent, so a training step's time minus the same
model's unsharded step, divided by the number of units, is CPU time per unit per forward +
backward (+ optimizer step, with --optimizer: a foreach AdamW over every contender's
parameters, the unsharded model's included, so that what remains is what sharding adds to
it). Part of it is the fake group's own: it still copies every rank's shard into the
gathered output and chunks the reduce-scatter's input. A second fsdp_compose model ran one
step under a StepTrace before timing (what a closed trace leaves behind). One more contender
does a unit's work by hand with nothing else (benchmarks/handwritten.py): the design's own
cost, about the least a runtime of this design can cost; its gradients are checked against
fsdp_compose's first. Further rounds time the calls into the process group, for every
contender, and report what remains as the runtime's own. On a one-rank gloo group the
runtimes skip communication altogether. The contenders run interleaved, in one process.

A unit is a Linear (--block linear) or a pre-norm transformer block of 12 parameters, as
GPT-2's (--block transformer: LayerNorm, fused qkv and output projections, LayerNorm, a 4x
MLP, all with biases): a real model's units hold several parameters, whose per-parameter
costs (registrations, collectives' tensor lists, optimizer state) a Linear's two hide.

Each backend's results go to overhead.json in --out under the backend's name (with the
block and optimizer appended unless they are the defaults), next to other runs' results,
with the machine, versions and date (benchmarks/report.py turns them into
docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from handwritten import shard_by_hand
from provenance import provenance
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compose import StepTrace, fully_shard
from fsdp_compose.comm.compat import ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD

# Per block, the defaults of --units and --batch: the transformer's blocks cost more to
# compute, and compute's noise is subtracted with the unsharded step's.
DEFAULTS = {"linear": {"units": 64, "batch": 8}, "transformer": {"units": 16, "batch": 4}}


class Block(nn.Module):
    """A pre-norm transformer block with GPT-2's 12 parameters (dim divisible by heads)."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp_norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, seq, head_dim)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


def build(args: argparse.Namespace, shard) -> nn.Module:
    torch.manual_seed(0)
    unit = (lambda: nn.Linear(args.dim, args.dim)) if args.block == "linear" else (lambda: Block(args.dim))
    model = nn.Sequential(*(unit() for _ in range(args.units)))
    if shard is shard_by_hand:
        shard(model)
    elif shard is not None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
    return model


class Contender:
    """A model and, with --optimizer, its AdamW (foreach, as on accelerators by default)."""

    def __init__(self, args: argparse.Namespace, shard) -> None:
        self.model = build(args, shard)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True) \
            if args.optimizer else None

    def step_seconds(self, x: torch.Tensor, steps: int) -> float:
        model, optimizer = self.model, self.optimizer
        start = time.perf_counter()
        for _ in range(steps):
            model(x).sum().backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
        return (time.perf_counter() - start) / steps


class CollectiveClock:
    """While installed, the seconds and calls spent inside the process group's all-gathers
    and reduce-scatters (the runtimes call one of these per unit and pass)."""

    # Their names on this torch.
    _METHODS = (ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD)

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


def check_by_hand(args: argparse.Namespace, x: torch.Tensor) -> None:
    """The hand-written units compute fsdp_compose's gradient shards, to the last bit."""
    ours, by_hand = build(args, fully_shard), build(args, shard_by_hand)
    for model in (ours, by_hand):
        for _ in range(2):  # the second adds to the first's .grad
            model(x).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), by_hand.parameters(), strict=True):
        if not torch.equal(p.grad.to_local(), q.grad):
            raise AssertionError(f"the hand-written units' gradient of {name} is not fsdp_compose's")


def fake_group_reduces() -> bool:
    """Whether the fake group's reduce-scatter writes its output (this rank's block of the
    input), as it does from torch 2.13 on. Before, it leaves the output as it was, so every
    runtime's gradients hold whatever memory held and there is nothing to compare."""
    output = torch.full((1,), -1.0)
    # The group's own method, as the runtimes call it (dist's wrapper is deprecated on 2.13).
    zeros = torch.zeros(dist.get_world_size())
    getattr(dist.group.WORLD, REDUCE_SCATTER_METHOD)(output, zeros, dist.ReduceScatterOptions()).wait()
    return output.item() == 0.0


def collective_seconds(contender: Contender, x: torch.Tensor, steps: int) -> tuple[float, float]:
    """Per step: seconds inside the process group's collectives, and how many calls."""
    with CollectiveClock() as clock:
        contender.step_seconds(x, steps)
    return clock.seconds / steps, clock.calls / steps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("fake", "gloo"), default="fake")
    parser.add_argument("--world", type=int, default=8, help="ranks simulated (fake backend)")
    parser.add_argument("--block", choices=tuple(DEFAULTS), default="linear", help="what a unit is")
    parser.add_argument("--optimizer", action="store_true", help="an AdamW step in every step")
    parser.add_argument("--units", type=int, help="64 Linear, 16 transformer blocks")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16, help="transformer blocks' sequence")
    parser.add_argument("--batch", type=int, help="8 with Linear, 4 with transformer blocks")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    for name, value in DEFAULTS[args.block].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def result_key(args: argparse.Namespace) -> str:
    """Where overhead.json keeps this run: the default block's under the backend's name."""
    if args.block == "linear" and not args.optimizer:
        return args.backend
    return f"{args.backend}, {args.block}" + (" + AdamW" if args.optimizer else "")


def main() -> None:
    args = parse_args()
    config = {**vars(args), **provenance()}
    start = time.perf_counter()
    if args.backend == "fake":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    shape = (args.batch, args.dim) if args.block == "linear" else (args.batch, args.seq, args.dim)
    x = torch.randn(shape)
    contenders = {
        "unsharded": Contender(args, None),
        "torch fully_shard": Contender(args, torch_fully_shard),
        "fsdp_compose": Contender(args, fully_shard),
        # What a StepTrace, opened and closed, leaves behind.
        "after a StepTrace": Contender(args, fully_shard),
        "by hand": Contender(args, shard_by_hand),
    }
    if args.backend == "gloo" or fake_group_reduces():
        check_by_hand(args, x)
    else:
        print("(the work by hand is not checked: this torch's fake group reduces nothing)")
    for contender in contenders.values():
        contender.step_seconds(x, 3)  # warm up: lazy init, allocator, optimizer state
    with StepTrace(contenders["after a StepTrace"].model):
        contenders["after a StepTrace"].step_seconds(x, 1)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):  # interleaved, so drift hits every contender alike
        for name, contender in contenders.items():
            times[name].append(contender.step_seconds(x, args.steps))
    inside: dict[str, list[float]] = {name: [] for name in contenders}
    calls: dict[str, float] = {}
    for _ in range(args.repeats):  # apart: the clock's own cost stays out of the step times
        for name, contender in contenders.items():
            seconds, calls[name] = collective_seconds(contender, x, args.steps)
            inside[name].append(seconds)
    variants = report(args, times, inside, calls)
    config["world_size"] = dist.get_world_size()
    config["wall_seconds"] = time.perf_counter() - start
    write(args.out, result_key(args), {"config": config, "variants": variants})
    dist.destroy_process_group()


def report(
    args: argparse.Namespace, times: dict[str, list[float]], inside: dict[str, list[float]],
    calls: dict[str, float],
) -> dict[str, dict]:
    """Print the table (and each contender's ratio to FSDP2); return the JSON's variants."""
    floor = statistics.median(times["unsharded"])
    unit = f"Linear({args.dim}, {args.dim})" if args.block == "linear" else \
        f"transformer block (dim {args.dim}, seq {args.seq}, 12 parameters)"
    print(f"torch {torch.__version__}  {args.backend}  world={dist.get_world_size()}  {args.units} x "
          f"{unit}  batch {args.batch}{'  + AdamW' if args.optimizer else ''}  median of {args.repeats}")
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
    theirs = variants["torch fully_shard"]["us_per_unit"]
    for variant in variants.values():
        variant["vs_fsdp2"] = variant["us_per_unit"] / theirs
    # Each round's ratio, its own unsharded step subtracted: how far the median can be trusted.
    rounds = [(ours - base) / (fsdp2 - base) for ours, fsdp2, base in
              zip(times["fsdp_compose"], times["torch fully_shard"], times["unsharded"])]
    print("per unit, against torch fully_shard: " + ", ".join(
        f"{name} {variants[name]['vs_fsdp2']:.3f}" for name in ("fsdp_compose", "after a StepTrace", "by hand")
    ) + f" (fsdp_compose's rounds: {min(rounds):.3f} to {max(rounds):.3f})")
    return variants


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
