"""A data-parallel group of one rank gathers nothing: its shards are the whole parameters,
so the unsharded parameters are views of them (no all-gather, no copy), and it trains as
torch's fully_shard and the single-process model do."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import fully_shard
from tests.dist.counting import ALL_GATHER
from tests.dist.parity import per_block, train_and_compare
from tests.models import Transformer, lm_loss, token_batch

COPIES = ("aten::copy_", "aten::split_with_sizes_copy", "aten::_to_copy", "aten::cat")


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def check_one_rank() -> dict[str, object]:
    errors = train_and_compare(Transformer, lm_loss, token_batch)
    torch.manual_seed(0)
    model = Transformer()
    per_block(model, fully_shard)
    shards = {name: p.to_local().untyped_storage().data_ptr() for name, p in model.named_parameters()}
    seen: dict[str, bool] = {}

    def views_of_shards(module, args) -> None:
        for name, p in module.named_parameters(prefix=module_names[module]):
            seen[name] = p.untyped_storage().data_ptr() == shards[name]

    module_names = {block: f"blocks.{i}" for i, block in enumerate(model.blocks)}
    for block in model.blocks:
        block.register_forward_pre_hook(views_of_shards)  # after fully_shard's: unsharded
    lm_loss(model, token_batch(0, 2)).backward()  # the first step: one-time checks
    with OpCounter() as ops:
        loss = lm_loss(model, token_batch(1, 2))
    forward = ops.counts
    with OpCounter() as ops:
        loss.backward()
    return {"errors": tuple(errors), "seen": seen, "forward": forward, "backward": ops.counts}


def test_one_rank_gathers_and_copies_nothing(ranks):
    result = ranks.run(check_one_rank, world_size=1)[0]
    vs_reference, vs_torch = result["errors"]
    assert vs_torch == 0.0 and vs_reference < 1e-6
    assert result["seen"] and all(result["seen"].values()), result["seen"]
    for counts in (result["forward"], result["backward"]):
        assert counts[ALL_GATHER] == 0
    assert not {op: n for op, n in result["forward"].items() if op in COPIES}, result["forward"]
