"""Custom collectives with torch's fully_shard interface (FSDPModule.set_custom_all_gather /
set_custom_reduce_scatter), shared by the tests that set them on ours and torch's alike."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class CountingAllGather(AllGather):
    """all_gather_into_tensor, counting calls and buffer allocations."""

    def __init__(self) -> None:
        self.calls = self.allocations = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class AllReduceThenSlice(ReduceScatter):
    """Another algorithm for a reduce-scatter: all-reduce the whole input, keep this rank's
    row (more traffic, same result). `premul`: the factor of a PREMUL_SUM it is asked for
    (an older torch's ReduceOp does not tell it)."""

    def __init__(self, premul: float | None = None) -> None:
        self.calls, self.premul = 0, premul
        self.ops: set[str] = set()

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        self.ops.add(str(getattr(op, "op", op)))  # a ReduceOp (PREMUL_SUM) or its type
        if op == ReduceOp.PREMUL_SUM:  # what NCCL's does: scale each input, then sum
            assert self.premul is not None, "a PREMUL_SUM this test did not expect"
            input_tensor.mul_(self.premul)
        dist.all_reduce(input_tensor, op=ReduceOp.SUM, group=group)  # gloo's has no AVG
        if op == ReduceOp.AVG:
            input_tensor.div_(group.size())
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None
