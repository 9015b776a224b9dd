"""What a framework script takes and records of its run, to compare torch's fully_shard
with fsdp_compose's: its arguments, every parameter whole (sum and sha256) and whose FSDP
classes annotated which module. Imported by the scripts beside it (their folder is first
on sys.path)."""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.distributed as dist


def checksums(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """Every parameter's full tensor (a collective: every rank calls it)."""
    sums = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        full = full.detach().cpu().contiguous()
        sums[name] = {
            "dtype": str(full.dtype),
            "sum": full.double().sum().item(),
            "sha256": hashlib.sha256(full.view(torch.uint8).numpy().tobytes()).hexdigest(),
        }
    return sums


def fsdp_classes(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each module fully_shard annotated: its FSDP classes, as module.qualname."""
    found = {}
    for name, module in model.named_modules():
        classes = [c for c in type(module).__mro__ if c.__name__ == "FSDPModule"]
        if classes:
            found[name or "<root>"] = [
                f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__
                if c.__name__.startswith("FSDP")
            ]
    return found


def script_arguments() -> argparse.Namespace:
    """Where to write the record and checkpoints, the precision, steps and save interval."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=2)
    return parser.parse_args()


def save(result: dict[str, object], path: str) -> None:
    """Rank 0 writes what the run recorded to `path` (JSON); every rank waits for it."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
