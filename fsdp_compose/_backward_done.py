"""How a unit learns that its backward is done, so that it can reduce and reshard.

Two signals. The cheap one: a hook on each unsharded parameter's gradient accumulation,
registered once per layout; the unit is done with its last gradient, since every node
that reads a parameter that requires grad computes a gradient for it, before that
gradient is accumulated. That fails when the unit has frozen parameters (their readers
compute none: in LoRA the adapters' gradients are complete while the frozen weight is
still needed for the inputs' gradient), and a parameter without gradient never completes
it. Then the general one: a hook on the backward node of each forward input, made at
every forward; the engine runs a node only when everything that feeds it is done, and
the gradients of the unit's inputs are the last thing its backward computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._param import ShardedParam


def hook_grad_accumulation(
    params: list[ShardedParam], hooked: list[nn.Parameter | None], hook: Callable[..., None]
) -> bool:
    """Put `hook` on the gradient accumulation of each unsharded parameter not in `hooked`
    (by position; updated). Returns False, hooking no further, at a parameter that does
    not require grad."""
    for i, p in enumerate(params):
        param = p.unsharded
        if not param.requires_grad:
            return False
        if hooked[i] is not param:
            param.register_post_accumulate_grad_hook(hook)
            hooked[i] = param
    return True


def hook_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], hook: Callable[..., None]
) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """`args` and `kwargs` with `hook` run once the backward of those of their tensors
    that require grad is done; and whether any did (else nothing will run it)."""
    if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
        # The common case, one tensor in: no pytree walk, and unless it is a leaf (a view
        # of which could not be modified in place), a view of it whose backward node runs
        # the hook: cheaper than an autograd Function.
        x = args[0]
        if not x.requires_grad:
            return args, kwargs, False
        if x.is_leaf:
            return _InputsDone.apply(hook, x), kwargs, True
        view = x.view_as(x)
        view.grad_fn.register_hook(hook)  # called with the node's gradients: unused
        return (view,), kwargs, True
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not where:
        return args, kwargs, False
    outs = _InputsDone.apply(hook, *(flat[i] for i in where))
    for i, out in zip(where, outs):
        flat[i] = out
    return (*tree_unflatten(flat, spec), True)


class _InputsDone(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs the hook."""

    @staticmethod
    def forward(
        ctx: Any, hook: Callable[[], None], *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)
