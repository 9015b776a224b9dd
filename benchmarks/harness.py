"""What the benchmark scripts share: --out, the process group, sharding with either runtime,
interleaved timing, and the JSON they write with where, when and how the run ran."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compose import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # train_gpt


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first line, and --out."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return parser


@contextmanager
def process_group(backend: str, world: int | None = None, rank: int = 0) -> Iterator[None]:
    """`world` ranks of the fake group, this one `rank` (its collectives fill their outputs
    without other processes); one rank of `backend` alone; or torchrun's ranks (world None)."""
    if backend == "fake":
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    elif world is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        gc.collect()  # meshes go before the process group (see examples/train_gpt.py)
        dist.destroy_process_group()


def interleaved(runs: dict[str, Callable], rounds: int, sync: Callable = lambda: None,
                warmup: int = 0) -> dict[str, list[float]]:
    """Seconds of each run per round after `warmup` untimed rounds. The runs take turns in
    alternating order, so that drift hits all alike; `sync` waits for a GPU's kernels."""
    seconds = {name: [] for name in runs}
    for r in range(warmup + rounds):
        for name in list(runs)[::1 if r % 2 == 0 else -1]:
            sync()
            start = time.perf_counter()
            runs[name]()
            sync()
            if r >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def shard(model: nn.Module, blocks: Iterable[nn.Module], runtime: str = "fsdp_compose",
          **options: object) -> nn.Module:
    """Each block a unit, then the root, by fsdp_compose's fully_shard or torch's ("FSDP2")."""
    shard_unit = fully_shard if runtime == "fsdp_compose" else torch_fully_shard
    for block in blocks:
        shard_unit(block, **options)
    shard_unit(model, **options)
    return model


def policy(runtime: str, param_dtype: torch.dtype | None = None,
           reduce_dtype: torch.dtype | None = None) -> object:
    make = MixedPrecisionPolicy if runtime == "fsdp_compose" else TorchMixedPrecisionPolicy
    return make(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def config(args: argparse.Namespace, where: torch.device | None = None, **more: object) -> dict:
    """The run's arguments, the date (UTC), torch and Python versions and the machine."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines()
             if cpuinfo.exists() else []) if line.startswith("model name")]
    machine = {"platform": platform.platform(),
               "cpu": names[0] if names else platform.processor() or platform.machine(),
               "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(),  # those this process may run on
               "gpu": torch.cuda.get_device_name(where) if where is not None
               and where.type == "cuda" else None}
    return {**vars(args), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": machine, "argv": sys.argv[1:], **more}


def write(out: Path, name: str, result: dict, started: float | None = None) -> None:
    """`result` as out/name.json, with the run's wall time since `started` in its config."""
    if started is not None:
        result["config"]["wall_seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out / name}.json")
