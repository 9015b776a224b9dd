"""Wrap policies: choose the submodules that become units, and call fully_shard on them
bottom-up, then on the root."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .fsdp_module import FSDPModule
from .fully_shard import fully_shard


@dataclass(frozen=True)
class WrapPolicy:
    """Which submodules become units: those of `module_classes`, those with at least
    `min_params` parameters not in a chosen submodule, or those `predicate(fqn, module)` picks."""

    module_classes: tuple[type[nn.Module], ...] = ()
    min_params: int | None = None
    predicate: Callable[[str, nn.Module], bool] | None = None


def wrap(model: nn.Module, policy: WrapPolicy, **fully_shard_kwargs: Any) -> FSDPModule:
    """Ours: `fully_shard(module, **fully_shard_kwargs)` on the submodules `policy` chooses,
    innermost first, then on `model`, the root."""
    if not isinstance(policy, WrapPolicy):
        raise TypeError(
            f"wrap: policy must be a fsdp_compose.WrapPolicy, got {type(policy).__name__}")
    for module in chosen_modules(model, policy):
        fully_shard(module, **fully_shard_kwargs)
    return fully_shard(model, **fully_shard_kwargs)


def chosen_modules(model: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The submodules of `model` (not `model` itself) `policy` chooses, children first."""
    chosen: list[nn.Module] = []

    def visit(module: nn.Module, fqn: str) -> int:  # returns its parameters left unchosen
        free = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            free += visit(child, f"{fqn}.{name}" if fqn else name)
        if module is not model and (
            isinstance(module, policy.module_classes)
            or (policy.min_params is not None and free >= policy.min_params)
            or (policy.predicate is not None and policy.predicate(fqn, module))
        ):
            chosen.append(module)
            return 0
        return free

    visit(model, "")
    return chosen
