"""Weights out and in, whole, for many small tensors and few large ones: iter_full_state_dict
against a loop of full_tensor() and DCP's get_model_state_dict; load_full_state_dict(model,
pairs) against DCP's set_model_state_dict. Per way: ms, collectives, peak tensor memory.

    torchrun --nproc_per_node=2 benchmarks/weights.py    # gloo, 2 ranks
    python benchmarks/weights.py --fake 8                # fake process group, 8 ranks
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import harness
import report
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.checkpoint import state_dict as dcp
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import iter_full_state_dict, load_full_state_dict

MODELS: dict[str, Callable[[], nn.Sequential]] = {
    "many small": lambda: nn.Sequential(*(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64))
                                          for _ in range(64))),
    "few large": lambda: nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4))),
}


class Collectives(TorchDispatchMode):
    """Collective ops dispatched, functional ones included (full_tensor's)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.name()
        return func(*args, **(kwargs or {}))


def measure(model: nn.Module, run: Callable[[], object], rounds: int) -> dict[str, float]:
    run()  # untimed: what a first call sets up
    seconds = []
    for _ in range(rounds):
        dist.barrier()  # the ranks start together
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
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
    return {"ms": statistics.median(seconds) * 1e3, "collectives": collectives.count,
            "peak MiB": peak}


def ways(model: nn.Module, whole: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    out = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    into = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def drain(items: Iterable[object]) -> None:
        for _ in items:
            pass  # sent on and dropped

    return {
        "out: iter_full_state_dict": lambda: drain(iter_full_state_dict(model)),
        "out: full_tensor() loop": lambda: drain(v.full_tensor()
                                                 for v in model.state_dict().values()),
        "out: DCP get_model_state_dict": lambda: dcp.get_model_state_dict(model, options=out),
        # Loading, the whole tensors are made as a reader would: streamed, or (DCP) all at once.
        "in: load_full_state_dict(pairs)": lambda: load_full_state_dict(
            model, ((k, v.clone()) for k, v in whole.items())),
        "in: DCP set_model_state_dict": lambda: dcp.set_model_state_dict(
            model, {k: v.clone() for k, v in whole.items()} if dist.get_rank() == 0 else {},
            options=into),
    }


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--fake", type=int, default=0,
                        help="ranks of a fake process group (0: torchrun's)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, dict[str, dict[str, float]]] = {}
    with harness.process_group("fake" if args.fake else "gloo", args.fake or None):
        for name, make in MODELS.items():
            torch.manual_seed(0)
            model = make()
            whole = {k: v.clone() for k, v in model.state_dict().items()}
            harness.shard(model, model)
            results[name] = {way: measure(model, run, args.rounds)
                             for way, run in ways(model, whole).items()}
        if dist.get_rank() == 0:
            result = {"config": harness.config(args, world=dist.get_world_size()),
                      "results": results}
            harness.write(args.out, "weights_fake" if args.fake else "weights", result)
            print(report.weights_table(result))


if __name__ == "__main__":
    main()
