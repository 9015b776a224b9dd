"""AdamW over fsdp_compose's sharded parameters, over torch's fully_shard's (FSDP2), and over
plain tensors of the same local shapes: the optimizer's cost of the DTensor contract.

    python benchmarks/optimizer.py          # fake group of 8, one process; CPU or one GPU

A model of 8 pre-norm blocks (dim 64 and 256: --dims; 12 parameters each) is sharded per block both ways
under each mixed-precision policy, one forward and backward gives every parameter its
gradient, and then only `optimizer.step()` is timed: for-loop, foreach and fused AdamW,
interleaved in rounds (median of rounds). The plain contender holds copies of
fsdp_compose's local shards and gradients as ordinary tensors: what the same arithmetic
costs without DTensor's dispatch. Writes optimizer.json to --out.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compose import MixedPrecisionPolicy, fully_shard

POLICIES = {  # name: (param_dtype, reduce_dtype)
    "none": (None, None),
    "bf16": (torch.bfloat16, None),
    "bf16, fp32 reduce": (torch.bfloat16, torch.float32),
}
VARIANTS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        x = x + self.proj(q * torch.sigmoid(k) * v)
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


def sharded(name: str, policy: str, dim: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(dim) for _ in range(8))).to(device)
    shard, make_policy = (fully_shard, MixedPrecisionPolicy) if name == "fsdp_compose" \
        else (torch_fully_shard, TorchPolicy)
    param_dtype, reduce_dtype = POLICIES[policy]
    kwargs = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),)),
              "mp_policy": make_policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    for block in model:
        shard(block, **kwargs)
    shard(model, **kwargs)
    model(torch.randn(4, 16, dim, device=device)).float().pow(2).mean().backward()
    return model


def plain_copies(model: nn.Module) -> list[nn.Parameter]:
    """Ordinary tensors holding the model's local shards and their gradients."""
    params = []
    for p in model.parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor)
        copy = nn.Parameter(p.to_local().detach().clone())
        copy.grad = p.grad.to_local().detach().clone()
        params.append(copy)
    return params


def timed(steps: dict[str, Callable[[], object]], rounds: int, calls: int, sync: Callable[[], None]) -> dict[str, float]:
    """ms per call of each, median over interleaved rounds (alternating order)."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                steps[name]()
            sync()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def by_variant(dim: int, policy: str, device: torch.device, args: argparse.Namespace,
               sync: Callable[[], None]) -> dict[str, dict[str, float]]:
    """ms per step of each contender, for-loop, foreach and fused AdamW."""
    models = {name: sharded(name, policy, dim, device) for name in ("fsdp_compose", "FSDP2")}
    params = {**{name: list(m.parameters()) for name, m in models.items()},
              "plain": plain_copies(models["fsdp_compose"])}
    results = {}
    for variant, options in VARIANTS.items():
        if variant == "fused" and device.type == "cpu" and not hasattr(torch, "_fused_adamw_"):
            continue
        optims = {name: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, **options)
                  for name, ps in params.items()}
        # fsdp_compose's optimizer runs its arithmetic on local tensors (param/local_step.py).
        steps = {name: (lambda o=o: o.step()) for name, o in optims.items()}
        results[variant] = timed(steps, args.rounds, args.calls, sync)
        ms = results[variant]
        print(f"dim {dim}, {policy}, {variant}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
              + f"; fsdp_compose / plain {ms['fsdp_compose'] / ms['plain']:.2f}, "
              f"FSDP2 / plain {ms['FSDP2'] / ms['plain']:.2f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="ranks simulated")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for dim in args.dims:
        for policy in POLICIES:
            results.setdefault(f"dim {dim}", {})[policy] = by_variant(dim, policy, device, args, sync)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {**vars(args), "out": str(args.out), "device": str(device), **provenance(device)}
    (args.out / "optimizer.json").write_text(json.dumps({"config": config, "ms_per_step": results}, indent=2))


if __name__ == "__main__":
    main()
