"""wrap(model, WrapPolicy(...)) gives the same units and the same training as the
hand-written loop of fully_shard calls."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from fsdp_compose import FSDPModule, MixedPrecisionPolicy, WrapPolicy, fully_shard, wrap
from tests.dist.parity import max_diff_to, optimizer_step, per_block, rank_share
from tests.models import Block, Transformer, lm_loss, token_batch


def check_wrap_matches_hand_loop() -> None:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    by_policy = Transformer(depth=3)
    by_hand = copy.deepcopy(by_policy)
    wrap(by_policy, WrapPolicy(module_classes=(Block,)), mp_policy=bf16)
    per_block(by_hand, fully_shard, mp_policy=bf16)
    units = [[fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
             for model in (by_policy, by_hand)]
    assert units[0] == units[1] == ["", "blocks.0", "blocks.1", "blocks.2"]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (by_policy, by_hand)]
    for step in range(2):
        tokens = rank_share(token_batch(step, 2 * dist.get_world_size()))
        for model in (by_policy, by_hand):
            lm_loss(model, tokens).backward()
        optimizer_step(optims)
    assert max_diff_to(by_policy, by_hand) == 0.0


def test_wrap_matches_hand_loop(ranks):
    ranks.run(check_wrap_matches_hand_loop, world_size=2)
