"""Selective activation checkpointing: torch's composable checkpoint on every n-th block."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint


def checkpoint_blocks(model: nn.Module, block_class: type[nn.Module], every: int = 1) -> list[str]:
    """Ours: recompute in backward the activations of every `every`-th `block_class` module of
    `model`, from the first; return their fqns. Before or after fully_shard alike."""
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpoint_blocks: every must be a positive int, got {every!r}")
    chosen = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, block_class)][::every]
    if not chosen:
        raise ValueError(f"checkpoint_blocks: {type(model).__name__} has no "
                         f"{block_class.__name__} modules")
    for _, block in chosen:
        checkpoint(block)
    return [fqn for fqn, _ in chosen]
