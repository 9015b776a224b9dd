"""HSDP: a reduced shard summed across the replicas, or kept as a partial sum between
all-reduces (set_requires_all_reduce(False) for gradient accumulation)."""

from __future__ import annotations

import torch

from ..comm.collectives import GradReduction, all_reduce, collective_failed
from ..param.sharded_param import ShardedParam
from .part import MeshPart


def combine_replicas(
    part: MeshPart, params: list[ShardedParam], sizes: list[int], reduced: torch.Tensor,
    reduction: GradReduction,
) -> bool:
    """Add each parameter's partial sum so far to its reduced shard and all-reduce across
    replicas, or, without all-reduce, keep the shards as partial sums. Whether they are final."""
    mesh, ledger = part.mesh, part.grads
    shards = list(zip(params, torch.split_with_sizes(reduced, sizes)))
    for p, shard in shards:
        if (partial := ledger.take_partial(p)) is not None:
            shard.add_(partial)
    if not part.settings.requires_all_reduce:
        ledger.keep_partial(shards)
        return False
    assert mesh.replicate_group is not None
    try:
        all_reduce(reduced, reduction.all_reduce_op, mesh.replicate_group)
    except RuntimeError as error:
        raise collective_failed(part.label, "all-reduce", mesh.replicate_size, error) from error
    ledger.spend_partial(p for p, _ in shards)
    return True
