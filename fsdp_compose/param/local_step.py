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

from ..comm.process_wide import Piece
from .replaced import MARKS, check_optimizer

# The torch.optim modules whose optimizer calls the module's function of the same name.
FUNCTIONALS = ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adamax", "nadam", "radam")
# The id of each live ShardedParam's sharded parameter: not an attribute (swap_tensors, as
# module.to_empty() calls it, swaps __dict__s) nor a weak reference (swap_tensors refuses
# those). A stale id can only make another DTensor's step local: the same arithmetic.
SHARDED_IDS: set[int] = set()
_enabled = True
_LOCAL = operator.attrgetter("_local_tensor")  # a DTensor's own local tensor
_PER_PARAMETER = (DTensor, type(None))  # the first of a list to unwrap (not scalar steps')
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]]
_checked = weakref.WeakKeyDictionary()


def set_local_optimizer_step(enabled: bool) -> None:
    """Whether torch's elementwise optimizers step fsdp_compose's parameters on their local
    tensors (the default: FSDP2's results at plain tensors' cost) or on the DTensors (FSDP2's
    code path, 1.5-7x slower)."""
    global _enabled
    _enabled = enabled


def _install() -> Callable[[], None]:
    """Wrap each elementwise optimizer's function and its class's `_init_group`; check
    optimizers for replaced tensors. Returns what undoes it."""
    hook = register_optimizer_step_pre_hook(_check_replaced)
    wrapped: list[tuple[object, str, Any]] = []  # (owner, name, original)
    for name in FUNCTIONALS:
        module = importlib.import_module(f"torch.optim.{name}")
        wrapped.append((module, name, getattr(module, name)))
        setattr(module, name, _on_local_tensors(getattr(module, name)))
        for cls in vars(module).values():  # the module's own classes (AdamW has Adam's)
            own = isinstance(cls, type) and cls.__module__ == module.__name__
            if own and "_init_group" in vars(cls):
                wrapped.append((cls, "_init_group", vars(cls)["_init_group"]))
                cls._init_group = _reading_dtensors_directly(cls._init_group)

    def undo() -> None:
        hook.remove()
        for owner, name, original in wrapped:
            setattr(owner, name, original)

    return undo


_LOCAL_STEP = Piece("local optimizer step (torch.optim wrapped, an optimizer pre-hook)", _install)


class Tracked:
    """One ShardedParam's place here: the local step installed while it lives, the id of its
    sharded parameter in SHARDED_IDS as long (and only the current one's)."""

    def __init__(self, owner: object) -> None:
        self._id: list[int] = []  # the finalizer's: a reference to `owner` would keep it
        _LOCAL_STEP.hold(owner)
        weakref.finalize(owner, SHARDED_IDS.difference_update, self._id)

    def sharded(self, param: torch.Tensor) -> None:
        """`param` is the owner's sharded parameter now."""
        SHARDED_IDS.difference_update(self._id)
        self._id[:] = [id(param)]
        SHARDED_IDS.add(id(param))


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
        first = _ours(params) if _enabled else None
        if first is None or kwargs.get("differentiable") or torch.compiler.is_compiling():
            return functional(*args, **kwargs)
        local_args, created = list(args), []
        for i, arg in enumerate(args):  # per-parameter lists: gradients, state
            if type(arg) is list and len(arg) == len(params) and type(arg[first]) in _PER_PARAMETER:
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


def _reading_dtensors_directly(init_group: Callable[..., Any]) -> Callable[..., Any]:
    """`_init_group` reads each parameter's `.grad` and state; on DTensors, whose
    __torch_function__ is disabled anyway, each read first looks for one: skipped, it costs
    half (54 against 18 µs for 96 parameters above plain tensors)."""
    @functools.wraps(init_group)
    def run(self: torch.optim.Optimizer, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if _enabled and _ours(group["params"]) is not None:
            with torch._C.DisableTorchFunctionSubclass():
                return init_group(self, group, *args, **kwargs)
        return init_group(self, group, *args, **kwargs)

    return run


def _ours(params: list[torch.Tensor]) -> int | None:
    """The index of the first DTensor in `params` if every DTensor there is a sharded
    parameter of ours (at least one); else None."""
    if SHARDED_IDS.issuperset(map(id, params)):
        return 0 if params else None
    at = [i for i, p in enumerate(params) if type(p) is DTensor]
    return at[0] if at and all(id(params[i]) in SHARDED_IDS for i in at) else None


def _like(param: torch.Tensor, value: Any) -> Any:
    """New state as the optimizer's caller sees it: a DTensor of the parameter's layout."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) \
            and value.shape == param._local_tensor.shape:
        return DTensor(value, param._spec, requires_grad=False)
    return value
