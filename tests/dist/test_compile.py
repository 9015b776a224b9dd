"""torch.compile of annotated blocks: our hooks run eagerly around the compiled forward,
and training stays in parity with single-process and with torch's fully_shard."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist.parity import (
    Shard,
    backward,
    max_diff,
    max_diff_to,
    optimizer_step,
    per_block,
    three_models,
    train_and_compare,
)
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


def check_compiled_model(backend: str) -> tuple[float, float]:
    """torch.compile(model) as scripts write it: the compiled wrapper trains, ours and
    torch's, against the single-process reference."""
    torch._dynamo.reset()
    ref, ours, theirs = three_models(lambda: Transformer(depth=2))
    compiled = [ref, torch.compile(ours, backend=backend), torch.compile(theirs, backend=backend)]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours, theirs)]
    vs_reference = vs_torch = 0.0
    for step in range(3):
        _, our_loss, their_loss = backward(compiled, token_batch(step, 4), lm_loss)
        vs_torch = max(
            vs_torch, max_diff(our_loss, their_loss), max_diff_to(ours, theirs, grads=True)
        )
        optimizer_step(optims)
        vs_torch = max(vs_torch, max_diff_to(ours, theirs))
        vs_reference = max(vs_reference, max_diff_to(ours, ref))
    return vs_reference, vs_torch


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_compiled_whole_model_trains_like_single_process_and_torch(ranks, backend):
    """torch.compile of the whole model (the Trainer's torch_compile=True): our hooks break
    the graph as torch's do, and training equals FSDP2's compiled training."""
    vs_reference, vs_torch = ranks.run(check_compiled_model, backend=backend, world_size=2,
                                       timeout=600)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-5
