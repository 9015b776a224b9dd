"""torch.compile of annotated blocks: our hooks run eagerly around the compiled forward,
and training stays in parity with single-process and with torch's fully_shard."""

from __future__ import annotations

import torch
from torch import nn

from tests.dist.parity import Shard, per_block, train_and_compare
from tests.models import Transformer, lm_loss, token_batch


def compile_blocks_after_annotation(model: nn.Module, shard: Shard) -> None:
    per_block(model, shard)
    for block in model.blocks:
        # aot_eager traces through dynamo and AOT autograd like inductor, without spending
        # the test's time on code generation.
        block.compile(backend="aot_eager")


def check_compiled_blocks() -> tuple[float, float]:
    torch._dynamo.reset()
    return train_and_compare(
        lambda: Transformer(depth=2), lm_loss, token_batch, wrap=compile_blocks_after_annotation
    )


def test_compiled_blocks_train_like_single_process_and_torch(ranks):
    vs_reference, vs_torch = ranks.run(check_compiled_blocks, world_size=2)[0]
    assert vs_reference < 1e-6
    assert vs_torch == 0.0
