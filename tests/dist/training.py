"""Small training loops the state-dict, checkpoint and init tests share."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compose import fully_shard
from tests.dist.parity import (
    assert_close_to,
    backward,
    full,
    optimizer_step,
    per_block,
    rank_share,
)
from tests.models import Transformer, lm_loss, token_batch


def sharded_transformer(seed: int, **kwargs: object) -> nn.Module:
    torch.manual_seed(seed)
    model = Transformer(**kwargs)
    per_block(model, fully_shard)
    return model


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        lm_loss(model, rank_share(token_batch(step, 2 * dist.get_world_size()))).backward()
        optimizer_step([optim])


def train_step_matches(model: nn.Module, ref: nn.Module) -> None:
    """One SGD step on each rank's share against the reference on all the data."""
    backward((ref, model), token_batch(0, 2 * dist.get_world_size()), lm_loss)
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert_close_to(model, ref)


def new_run(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = sharded_transformer(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def whole_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, whole, keyed by name."""
    state = {fqn: full(p).clone() for fqn, p in model.named_parameters()}
    for fqn, p in model.named_parameters():
        for key, value in optim.state[p].items():
            state[f"{fqn}/{key}"] = full(value).clone()
    return state
