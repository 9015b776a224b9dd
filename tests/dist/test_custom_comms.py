"""Custom all-gather and reduce-scatter per unit, with torch's fully_shard interface: the
same comm objects give the same training under fsdp_compose and torch's fully_shard."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from tests.dist.parity import Shard, per_block, train_and_compare
from tests.models import Transformer, lm_loss, token_batch


class CountingAllGather(AllGather):
    """all_gather_into_tensor, counting calls and buffer allocations."""

    def __init__(self) -> None:
        self.calls = self.allocations = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class AllReduceThenSlice(ReduceScatter):
    """Another algorithm for a reduce-scatter: all-reduce the whole input, keep this rank's
    row (more traffic, same result)."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        dist.all_reduce(input_tensor, op=ReduceOp.SUM, group=group)  # gloo's has no AVG
        if op == ReduceOp.AVG:
            input_tensor.div_(group.size())
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None


def with_custom_comms(comms: list) -> callable:
    def wrap(model: nn.Module, shard: Shard) -> None:
        per_block(model, shard)
        gather, reduce = CountingAllGather(), AllReduceThenSlice()
        comms.append((gather, reduce))
        for module in model.modules():
            if hasattr(module, "set_custom_all_gather"):  # annotated, by us or by torch
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(reduce)
    return wrap


def check_custom_comms() -> tuple[tuple[float, float], list[tuple[int, int, int]]]:
    comms: list = []
    errors = train_and_compare(
        lambda: Transformer(depth=2), lm_loss, token_batch, steps=2, wrap=with_custom_comms(comms)
    )
    return errors, [(g.calls, g.allocations, r.calls) for g, r in comms]


def test_custom_comms_train_like_torch_with_the_same_comms(ranks):
    (vs_reference, vs_torch), (ours, theirs) = ranks.run(check_custom_comms, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6
    # Per step: 3 units gathered in forward, 2 blocks again in backward; 3 reductions.
    assert ours == theirs == (10, 10, 6)
