"""Every collective fsdp_compose sends: one all-gather of a unit's padded shards, one
reduce-scatter of its padded gradients. Nothing else in the package calls torch.distributed
collectives, so this file shows all we put on the wire."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp


class GradReduction(NamedTuple):
    """How a unit's gradients are averaged: scale before, reduce with `op`, scale after."""

    pre_scale: float | None
    op: ReduceOp.RedOpType
    post_divide: float | None


def grad_reduction(
    shard_size: int, dtype: torch.dtype, divide_factor: float | None, force_sum: bool
) -> GradReduction:
    """The reduction that divides summed gradients by `divide_factor` (default: shard_size).

    The backend's own AVG is cheapest; a custom factor is a pre-scaled SUM (the math of
    ReduceOp.PREMUL_SUM, which gloo lacks); `force_sum` keeps the wire op a plain SUM and
    divides afterwards. In float16, whose range is narrow, the division is split around the
    SUM (about sqrt(factor) before, the rest after) so neither the sum overflows nor the
    pre-scaled gradients underflow. The same choices as torch's fully_shard.
    """
    factor = float(shard_size) if divide_factor is None else float(divide_factor)
    if dtype in (torch.float32, torch.bfloat16) and not force_sum:
        if factor == shard_size:
            # A group of one has nothing to average; some backends mishandle AVG there.
            return GradReduction(None, ReduceOp.SUM if shard_size == 1 else ReduceOp.AVG, None)
        return GradReduction(1.0 / factor, ReduceOp.SUM, None)
    if dtype in (torch.float32, torch.bfloat16):
        return GradReduction(None, ReduceOp.SUM, factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    post = factor / pre
    return GradReduction(1.0 / pre if pre != 1 else None, ReduceOp.SUM, post if post != 1 else None)


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool
) -> dist.Work | None:
    """Gather every rank's equal-sized flat `shard` into `output`, rank after rank."""
    return dist.all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, reduction: GradReduction
) -> None:
    """Reduce `input` (row r: the values for rank r) across ranks; rank r keeps row r."""
    if reduction.pre_scale is not None:
        input.mul_(reduction.pre_scale)
    dist.reduce_scatter_single(output, input, op=reduction.op, group=group)
    if reduction.post_divide is not None:
        output.div_(reduction.post_divide)


def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType, group: ProcessGroup) -> None:
    """Reduce `tensor` in place across `group`."""
    dist.all_reduce(tensor, op=op, group=group)
