"""The optimizer step on local shards: torch's elementwise optimizers (SGD, Adam, AdamW and the
like) step our sharded parameters on their local tensors, without DTensor's dispatch: the same
kernels, bit for bit, at a plain tensor's cost.

Each of these optimizers runs its `step()` as torch wrote it, on the DTensors: its hooks, its LR
schedulers, its state and param groups, a closure and GradScaler see exactly what they see on
FSDP2, at every moment. Only the last call is changed: the step hands its parameters, gradients
and state in lists to one module-level function of elementwise arithmetic (`torch.optim.adam.
adam`, `torch.optim.sgd.sgd`, ...), and that function, given parameters of ours, runs on their
local tensors. State it creates in those lists (SGD's momentum buffers) goes back as DTensors of
the parameter's layout. `set_local_optimizer_step(False)` runs them on the DTensors instead."""

from __future__ import annotations

import functools
import importlib
import itertools
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .replaced import MARKS, check_optimizer

# The torch.optim modules whose optimizer calls the module's function of the same name.
FUNCTIONALS = ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adamax", "nadam", "radam")
# The id of every sharded parameter fully_shard makes: not an attribute (swap_tensors, as
# module.to_empty() calls it, swaps __dict__s) nor a weak reference (swap_tensors refuses
# those). A stale id can only make another DTensor's step local: the same arithmetic.
SHARDED_IDS: set[int] = set()
_enabled = True
_LOCAL = operator.attrgetter("_local_tensor")  # a DTensor's own local tensor
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = weakref.WeakKeyDictionary()


def set_local_optimizer_step(enabled: bool) -> None:
    """Whether torch's elementwise optimizers step fsdp_compose's parameters on their local
    tensors (the default: FSDP2's results at plain tensors' cost) or on the DTensors (FSDP2's
    code path, 1.5-7x slower)."""
    global _enabled
    _enabled = enabled


@functools.cache
def install() -> None:
    """Wrap each elementwise optimizer's function; check optimizers for replaced tensors."""
    register_optimizer_step_pre_hook(_check_replaced)
    for name in FUNCTIONALS:
        module = importlib.import_module(f"torch.optim.{name}")
        setattr(module, name, _on_local_tensors(getattr(module, name)))


def _check_replaced(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Refuse replaced tensors; again only once more were marked or groups were added."""
    seen = (MARKS[0], len(optimizer.param_groups))
    if _checked.get(optimizer) != seen:
        check_optimizer(optimizer)
        _checked[optimizer] = seen


def _on_local_tensors(functional: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(functional)
    def step(*args: Any, **kwargs: Any) -> Any:
        params = args[0]  # then per-parameter lists: gradients, state (None: to create)
        if not (_enabled and _ours(params)) or kwargs.get("differentiable") \
                or torch.compiler.is_compiling():
            return functional(*args, **kwargs)
        local_args, created = list(args), []
        for i, arg in enumerate(args):  # per-parameter lists: gradients, state
            if type(arg) is list and len(arg) == len(params):
                try:
                    local_args[i] = list(map(_LOCAL, arg))  # all DTensors, at C speed
                except AttributeError:  # plain tensors, or None where state is to be made
                    local_args[i] = local = [_LOCAL(t) if type(t) is DTensor else t for t in arg]
                    if any(map(operator.is_, local, itertools.repeat(None))):
                        created.append((i, list(local)))
        out = functional(*local_args, **kwargs)
        for i, before in created:  # state the function made (SGD's momentum): DTensors
            for j, (new, old) in enumerate(zip(local_args[i], before)):
                if new is not old:
                    args[i][j] = _like(params[j], new)
        return out

    return step


def _ours(params: list[torch.Tensor]) -> bool:
    """Whether every DTensor in `params` is a sharded parameter of ours (at least one)."""
    if SHARDED_IDS.issuperset(map(id, params)):
        return len(params) > 0
    dtensors = [p for p in params if type(p) is DTensor]
    return bool(dtensors) and all(id(p) in SHARDED_IDS for p in dtensors)


def _like(param: torch.Tensor, value: Any) -> Any:
    """New state as the optimizer's caller sees it: a DTensor of the parameter's layout."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) \
            and value.shape == param._local_tensor.shape:
        return DTensor(value, param._spec, requires_grad=False)
    return value
