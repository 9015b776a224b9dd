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
    """Which submodules become units of their own. A submodule is chosen when any rule says
    so: `module_classes` (e.g. the decoder layer class), `min_params` (at least this many
    parameters not already in a chosen submodule below it), or `predicate(fqn, module)`."""

    module_classes: tuple[type[nn.Module], ...] = ()
    min_params: int | None = None
    predicate: Callable[[str, nn.Module], bool] | None = None


def wrap(model: nn.Module, policy: WrapPolicy, **fully_shard_kwargs: Any) -> FSDPModule:
    """Annotate the submodules `policy` chooses, innermost first, then `model` (the root),
    each with `fully_shard(module, **fully_shard_kwargs)`: the same as the hand-written

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)

    when `policy` is `WrapPolicy(module_classes=(Block,))`. Ours, not torch's.
    """
    if not isinstance(policy, WrapPolicy):
        raise TypeError(f"wrap: policy must be a fsdp_compose.WrapPolicy, got {type(policy).__name__}")
    for module in chosen_modules(model, policy):
        fully_shard(module, **fully_shard_kwargs)
    return fully_shard(model, **fully_shard_kwargs)


def chosen_modules(model: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The submodules of `model` (not `model` itself) that `policy` makes units, children
    before parents."""
    chosen: list[nn.Module] = []

    def visit(module: nn.Module, fqn: str) -> int:
        """Choose under `module`; return its parameters not in a chosen submodule."""
        free = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            free += visit(child, f"{fqn}.{name}" if fqn else name)
        if module is model or not _is_chosen(policy, fqn, module, free):
            return free
        chosen.append(module)
        return 0

    visit(model, "")
    return chosen


def _is_chosen(policy: WrapPolicy, fqn: str, module: nn.Module, free_params: int) -> bool:
    return (
        isinstance(module, policy.module_classes)
        or (policy.min_params is not None and free_params >= policy.min_params)
        or (policy.predicate is not None and policy.predicate(fqn, module))
    )
