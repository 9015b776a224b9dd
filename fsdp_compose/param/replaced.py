"""Tensors fully_shard no longer uses: the parameters it replaced, and tensors assigned over
sharded parameters (copied in, with a warning). An optimizer holding one is refused."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

_REPLACED_MARK = "_fsdp_compose_replaced"
MARKS = [0]  # how many times tensors were marked: an optimizer checked since needs no new check


def mark_replaced(name: str, replaced: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Mark the parameters (fqn, parameter) that fully_shard(`name`) replaced."""
    MARKS[0] += 1
    for fqn, param in replaced:
        setattr(param, _REPLACED_MARK, f"parameter {fqn!r} of {name} as it was before "
                "fully_shard, which replaced it by a sharded DTensor")


def warn_copied(fqn: str, replacement: torch.Tensor) -> None:
    """Warn that `replacement` was copied into sharded parameter `fqn`, and mark it."""
    MARKS[0] += 1
    setattr(replacement, _REPLACED_MARK, f"the tensor assigned to parameter {fqn!r} after "
            "fully_shard, whose values were copied into the sharded parameter the model keeps")
    warnings.warn(
        f"fsdp_compose: parameter {fqn!r} was replaced after fully_shard by a new tensor. Its "
        "values were copied into the model's sharded parameter (the object that model."
        "parameters() and optimizers built before return), which trains on; the new object is "
        "not part of the model. To avoid this warning, change the parameter in place (with "
        "torch.no_grad(): param.copy_(value)) or replace it before fully_shard.",
        stacklevel=2,
    )


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds a marked tensor."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if (where := getattr(param, _REPLACED_MARK, None)) is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds {where}: stepping it would change "
                    "nothing the model uses. Build the optimizer after fully_shard (and after "
                    "replacing parameters), from model.parameters()."
                )
