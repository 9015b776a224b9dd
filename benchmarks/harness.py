"""What the benchmark scripts share: --out, the process group, sharding with either runtime,
interleaved timing, the JSON they write with where, when and how the run ran, and the models
beside examples/train_gpt.py's GPT: GPT-2's pre-norm transformer block (a unit of 12
parameters) for overhead.py and optimizer.py, and a Llama-style decoder for step.py."""

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
import torch.nn.functional as F
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
          param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
          **options: object) -> nn.Module:
    """Each block a unit, then the root, by fsdp_compose's fully_shard or torch's ("FSDP2"),
    under the mixed-precision policy of these dtypes."""
    ours = runtime == "fsdp_compose"
    policy = (MixedPrecisionPolicy if ours else TorchMixedPrecisionPolicy)(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in (*blocks, model):
        (fully_shard if ours else torch_fully_shard)(unit, mp_policy=policy, **options)
    return model


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


class Block(nn.Module):
    """A pre-norm transformer block with GPT-2's 12 parameters (dim divisible by heads)."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.qkv = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim)
        self.proj, self.mlp_norm = nn.Linear(dim, dim), nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, seq, head_dim)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class LlamaBlock(nn.Module):
    """Bias-free attention and a SwiGLU MLP, RMSNorm before each. No rotary embeddings: the
    counting data needs no positions, and a step's cost is in the matrix multiplies."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        hidden = -(-8 * dim // (3 * 64)) * 64  # Llama's: 8/3 of dim, up to a multiple of 64
        self.heads, self.attn_norm = heads, nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(dim)
        self.w1, self.w2, self.w3 = (nn.Linear(a, b, bias=False) for a, b in
                                     ((dim, hidden), (hidden, dim), (dim, hidden)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (batch, seq, dim), h = x.shape, self.attn_norm(x)
        q, k, v = (w(h).view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(out.transpose(1, 2).reshape(batch, seq, dim))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Built and trained as the GPT is, one unit per block; `seq` is unused (no position
    embedding)."""

    def __init__(self, vocab: int, dim: int, heads: int, depth: int, seq: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"Llama(dim={dim}, heads={heads}): dim must be a multiple of heads")
        self.tok_emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads) for _ in range(depth))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))
