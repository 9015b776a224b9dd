"""How a unit's parameters lie in memory: their padded shards back to back in one flat
tensor (which the all-gather sends as is), their unsharded data in one storage, and their
registrations grouped by owning module (what one dict update swaps)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ._param import Registration, ShardedParam

# One owning module's _parameters, and the sharded and the unsharded forms of its
# parameters in a unit, by name: what one dict update registers.
OwnerForms = tuple[dict[str, Any], dict[str, nn.Parameter], dict[str, nn.Parameter]]


def flat_shards(params: list[ShardedParam], numel: int) -> torch.Tensor | None:
    """One flat tensor holding every parameter's padded shard (each parameter's shard then
    a view of it), when they share a dtype and a device; else None."""
    first = params[0].padded_shard
    if not all(p.padded_shard.dtype == first.dtype and p.padded_shard.device == first.device
               for p in params):
        return None
    # Parameters outlive an inference_mode forward that may get here first.
    with torch.inference_mode(False), torch.no_grad():
        flat = torch.empty(numel, dtype=first.dtype, device=first.device, pin_memory=first.is_pinned())
        for p, piece in zip(params, flat.split([p.layout.padded_shard_numel for p in params])):
            p.move_shard_into(piece)
    return flat


def unsharded_buffers(
    params: list[ShardedParam], rows: int, sizes: list[int], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """The unsharded data: one storage shared by the parameters when they compute in one
    dtype, else each its own."""
    if not all(p.param_dtype == dtype for p in params):
        return [p.unsharded_buffer for p in params]
    with torch.inference_mode(False):
        unsharded = torch.empty(rows * sum(sizes), dtype=dtype, device=device)
        for p, piece in zip(params, unsharded.split([rows * n for n in sizes])):
            p.use_unsharded_buffer(piece)
    return [unsharded]


def forms_by_owner(registrations: Iterable[Registration]) -> list[OwnerForms]:
    """Registrations grouped by owning module."""
    by_owner: dict[int, OwnerForms] = {}
    for r in registrations:
        _, sharded, unsharded = by_owner.setdefault(id(r.parameters), (r.parameters, {}, {}))
        sharded[r.name] = r.sharded
        unsharded[r.name] = r.unsharded
    return list(by_owner.values())
