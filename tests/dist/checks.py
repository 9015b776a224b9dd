"""Checks run by more than one test module (as the body of a `ranks.run`)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_compose import fully_shard
from tests.dist.parity import Shard as ShardFn
from tests.dist.parity import assert_close_to, backward, make_mesh, three_models
from tests.models import MLP, feature_batch, mse_loss


def check_hsdp_accumulation_without_all_reduce(
    shard_fns: tuple[ShardFn, ShardFn] = (fully_shard, torch_fully_shard),
) -> None:
    models = ref, ours, theirs = three_models(MLP, make_mesh((2, 2)), shard_fns=shard_fns)
    for micro in range(3):
        for model in (ours, theirs):
            model.set_requires_all_reduce(micro == 2)
        backward(models, feature_batch(micro, 2 * dist.get_world_size()), mse_loss)
    assert_close_to(ours, ref, grads=True)
    assert_close_to(ours, theirs, grads=True)
