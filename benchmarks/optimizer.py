"""AdamW's step alone over fsdp_compose's sharded parameters, over FSDP2's, and over plain
tensors holding the same local shards and gradients (the cost of DTensor's dispatch), per
mixed-precision policy and AdamW variant (for-loop, foreach, fused), interleaved.

    python benchmarks/optimizer.py          # fake group of 8, one process; CPU or one GPU
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import harness
import report
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

POLICIES = {  # name: (param_dtype, reduce_dtype)
    "none": (None, None),
    "bf16": (torch.bfloat16, None),
    "bf16, fp32 reduce": (torch.bfloat16, torch.float32),
}
VARIANTS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
WORLD = 8


def sharded(name: str, policy: str, dim: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(harness.Block(dim) for _ in range(8))).to(device)
    harness.shard(model, model, name, *POLICIES[policy],
                  mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    model(torch.randn(4, 16, dim, device=device)).float().pow(2).mean().backward()
    return model


def by_variant(dim: int, policy: str, device: torch.device, args: argparse.Namespace,
               sync: Callable[[], object]) -> dict[str, dict[str, float]]:
    """ms per step of each contender, for-loop, foreach and fused AdamW."""
    models = {name: sharded(name, policy, dim, device) for name in ("fsdp_compose", "FSDP2")}
    params = {name: list(m.parameters()) for name, m in models.items()}
    params["plain"] = [nn.Parameter(p.to_local().detach().clone()) for p in params["fsdp_compose"]]
    for copy, p in zip(params["plain"], params["fsdp_compose"]):  # ordinary tensors, same shards
        copy.grad = p.grad.to_local().detach().clone()
    results = {}
    for variant, options in VARIANTS.items():
        optims = {name: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, **options)
                  for name, ps in params.items()}
        runs = {name: (lambda o=o: [o.step() for _ in range(args.calls)])
                for name, o in optims.items()}
        seconds = harness.interleaved(runs, args.rounds, sync, warmup=1)  # AdamW's state
        ms = results[variant] = {name: statistics.median(t) / args.calls * 1e3
                                 for name, t in seconds.items()}
        print(f"dim {dim}, {policy}, {variant}: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
    return results


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5, help="steps per round")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results: dict[str, dict] = {}
    with harness.process_group("fake", WORLD):
        for dim in args.dims:
            results[f"dim {dim}"] = {policy: by_variant(dim, policy, device, args, sync)
                                     for policy in POLICIES}
    result = {"config": harness.config(args, device, world=WORLD, device=str(device)),
              "ms_per_step": results}
    harness.write(args.out, "optimizer", result)
    print(report.optimizer_table(result))


if __name__ == "__main__":
    main()
