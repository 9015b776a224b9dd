"""clip_grad_norm_ for gradients sharded over any meshes: the true global norm, then scaling."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from ..comm.collectives import all_reduce
from ..comm.meshes import mesh_device


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of `parameters` to a global norm of at most `max_norm`; return the
    norm before scaling, the same on every rank. Gradients may be DTensors on any meshes (FSDP,
    HSDP, TP) or plain, replicated tensors. Call it on every rank with the same parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = total_norm(grads, float(norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is "
                           f"{total.item()}; pass error_if_nonfinite=False to scale anyway "
                           "(the gradients become non-finite).")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.device, local.dtype))
    return total


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of all `grads` as one vector. Those sharded over the same mesh dims combine
    locally, then with one all-reduce per dim: a sum of p-th powers (a max for the inf-norm)."""
    groups: dict[tuple[DeviceMesh | None, tuple[int, ...]], list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        groups.setdefault(_shard_dims(grad), []).append(local)
    is_max = math.isinf(norm_type)
    parts = []
    for (mesh, dims), locals_ in groups.items():
        # An empty shard (dim 0 shorter than the mesh) contributes nothing.
        norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32)
                 for t in locals_ if t.numel()]
        stacked = torch.stack(norms) if norms else torch.zeros(1, device=locals_[0].device)
        part = stacked.max() if is_max else stacked.pow(norm_type).sum()
        if mesh is not None and dims:
            # CPU-offloaded gradients reduce on the mesh's device.
            part = part.to(mesh_device(mesh))
            for dim in dims:
                all_reduce(part, ReduceOp.MAX if is_max else ReduceOp.SUM, mesh.get_group(dim))
        parts.append(part)
    combined = torch.stack([part.to(parts[0].device) for part in parts])
    return combined.max() if is_max else combined.sum().pow(1.0 / norm_type)


def _shard_dims(grad: torch.Tensor) -> tuple[DeviceMesh | None, tuple[int, ...]]:
    if not isinstance(grad, DTensor):
        return None, ()
    if any(p.is_partial() for p in grad.placements):
        raise ValueError(f"clip_grad_norm_: a gradient has a Partial placement ({grad.placements});"
                         " its norm needs the reduced gradient. Reduce it first (e.g. grad."
                         "redistribute(..., Replicate())) or let the backward finish.")
    placements = enumerate(grad.placements)
    # _StridedShard: FSDP over TP rows.
    dims = (d for d, p in placements if p.is_shard() or isinstance(p, _StridedShard))
    return grad.device_mesh, tuple(dims)
