"""Weights out and in, whole: fsdp_compose.iter_full_state_dict (one all-gather per unit)
against a loop of full_tensor() (one per tensor) and torch.distributed.checkpoint's
get_model_state_dict(full_state_dict=True, cpu_offload=True); loading whole tensors with
load_full_state_dict(model, pairs) against set_model_state_dict(full_state_dict=True,
broadcast_from_rank0=True). Two models: many small tensors (64 blocks of LayerNorm and
Linear, dim 64) and few large ones (4 Linear(1024, 1024)), a unit per block.

    torchrun --nproc_per_node=2 benchmarks/weights.py    # gloo, 2 ranks
    python benchmarks/weights.py --fake 8                # fake process group, 8 ranks

Per way: ms (median of --rounds), collectives dispatched, and the peak of tensor memory
above what was live before (torch's MemTracker), the consumer dropping each tensor as it
arrives (as a sender to an inference engine does). Rank 0 prints a table and writes
weights.json to --out.
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
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import fully_shard, iter_full_state_dict, load_full_state_dict

MODELS: dict[str, Callable[[], nn.Module]] = {
    "many small": lambda: nn.Sequential(*(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64))
                                          for _ in range(64))),
    "few large": lambda: nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4))),
}


class Collectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.name()
        return func(*args, **(kwargs or {}))


def measure(model: nn.Module, run: Callable[[], object], rounds: int) -> dict[str, float]:
    run()  # untimed: what a first call sets up
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    with Collectives() as collectives:
        run()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        live = tracker.get_tracker_snapshot("current")
        run()
    high = tracker.get_tracker_snapshot("peak")
    device = next(iter(high))
    peak = (high[device]["Total"] - live[device]["Total"]) / 2**20
    return {"ms": statistics.median(times) * 1e3, "collectives": collectives.count, "peak MiB": peak}


def ways(model: nn.Module, whole: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    out = StateDictOptions(full_state_dict=True, cpu_offload=True)
    into = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def drain(items) -> None:
        for _ in items:
            pass  # sent on and dropped
    return {
        "out: iter_full_state_dict": lambda: drain(iter_full_state_dict(model)),
        "out: full_tensor() loop": lambda: drain(v.full_tensor() for v in model.state_dict().values()),
        "out: DCP get_model_state_dict": lambda: get_model_state_dict(model, options=out),
        # Loading, the whole tensors are made as a reader would: streamed, or (DCP) all at once.
        "in: load_full_state_dict(pairs)": lambda: load_full_state_dict(
            model, ((k, v.clone()) for k, v in whole.items())),
        "in: DCP set_model_state_dict": lambda: set_model_state_dict(
            model, {k: v.clone() for k, v in whole.items()} if dist.get_rank() == 0 else {},
            options=into),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", type=int, default=0, help="ranks of a fake process group (0: torchrun's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if args.fake:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake)
    else:
        dist.init_process_group("gloo")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make()
        whole = {k: v.clone() for k, v in model.state_dict().items()}
        for block in model:
            fully_shard(block)
        fully_shard(model)
        results[name] = {way: measure(model, run, args.rounds) for way, run in ways(model, whole).items()}
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"{'fake' if args.fake else 'gloo'}, {world} ranks; ms, collectives, peak MiB above live")
        for name, by_way in results.items():
            loop = by_way["out: full_tensor() loop"]["ms"]
            for way, r in by_way.items():
                print(f"{name:<11} {way:<34} {r['ms']:9.2f} ms {r['collectives']:5.0f} "
                      f"{r['peak MiB']:8.2f} MiB" + (f"   {r['ms'] / loop:.2f}x the loop" if way.startswith("out") else ""))
        args.out.mkdir(parents=True, exist_ok=True)
        config = {**vars(args), "out": str(args.out), "world": world, **provenance()}
        (args.out / f"weights{'_fake' if args.fake else ''}.json").write_text(
            json.dumps({"config": config, "results": results}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
