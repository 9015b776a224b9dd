"""The optimizer step on local shards: torch's elementwise optimizers (SGD, Adam, AdamW and the like)
step on the sharded parameters' local tensors, without DTensor's dispatch: the same arithmetic, bit for bit.

Outside `step()` nothing changes: param groups hold the DTensor parameters and `optimizer.state`
DTensors (state_dict(), DCP, clip_grad_norm_, LR schedulers and GradScaler see what they always
see). During the step the optimizer holds the local tensors, their `.grad` the DTensor gradients'
local tensors, and state of their local parts. Only these exact classes (an optimizer that reads
global shapes, as Shampoo or Muon do, must see DTensors), from their second step (the first
creates their state), through an instance `step` wrapping the class's; its step hooks run inside."""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .replaced import check_optimizer

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
)
# The id of every sharded parameter fully_shard makes: not an attribute (swap_tensors, as
# module.to_empty() calls it, swaps __dict__s) nor a weak reference (swap_tensors refuses
# those). A stale id can only make another tensor's optimizer step locally: same arithmetic.
SHARDED_IDS: set[int] = set()
_SEEN = "_fsdp_compose_local_step"  # in an optimizer's __dict__: it steps its own way


@functools.cache
def install() -> None:
    """At every optimizer's first step (a global pre-hook): refuse replaced tensors, choose how it steps."""
    register_optimizer_step_pre_hook(_first_step)


def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Until an elementwise optimizer holds a sharded parameter (a framework may step it
    once before the model is sharded), look again at each step."""
    if optimizer.__dict__.get(_SEEN):
        return
    check_optimizer(optimizer)
    if type(optimizer) not in ELEMENTWISE:
        optimizer.__dict__[_SEEN] = True
    elif any(id(p) in SHARDED_IDS for group in optimizer.param_groups for p in group["params"]):
        optimizer.__dict__[_SEEN] = True
        optimizer.step = _LocalStep(optimizer, optimizer.step)  # type: ignore[method-assign]


class _LocalStep:
    """`optimizer.step`, run on the local tensors (see the module's docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> None:
        self._optimizer, self._step = optimizer, step
        self._outside: Any = None  # the state dict the inside one was built from
        self._inside: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        self._params: list[torch.Tensor] = []  # every group's, when the inside state was built
        self._locals: list[torch.Tensor] = []  # their local tensors then
        self._counted = (0, 0)  # the inside state's entries and keys when last in sync

    def __call__(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """As torch's step. A closure computes the gradients, of the DTensors, so it runs
        first, as these optimizers run it before they read a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        optimizer = self._optimizer
        groups: list[list[torch.Tensor]] = [group["params"] for group in optimizer.param_groups]
        params = [p for group in groups for p in group]
        # Enter: give the optimizer each parameter's local tensor, the local tensor of its
        # DTensor gradient as `.grad`, and the state of those.
        locals_ = [p._local_tensor if isinstance(p, DTensor) else p for p in params]
        start = 0
        for group, group_params in zip(optimizer.param_groups, groups):
            group["params"] = locals_[start : start + len(group_params)]
            start += len(group_params)
        with torch._C.DisableTorchFunctionSubclass():  # DTensor's `.grad` without its dispatch
            grads = [p.grad for p in params]
        for p, local, grad in zip(params, locals_, grads):
            if local is not p:
                local.grad = None if grad is None else grad._local_tensor  # type: ignore[attr-defined]
        if optimizer.state is not self._outside or not (
            _identical(params, self._params) and _identical(locals_, self._locals)
        ):
            self._take_state(params, locals_)
        optimizer.state = self._inside
        try:
            self._step(**kwargs)
        finally:  # leave: the DTensors and their state back in the optimizer
            for group, group_params in zip(optimizer.param_groups, groups):
                group["params"] = group_params
            for p, local in zip(params, locals_):
                if local is not p:
                    local.grad = None  # the gradient stays the DTensor's: hold it once
            if (counted := _count(self._inside)) != self._counted:
                self._sync_outside()
                self._counted = counted
            optimizer.state = self._outside
        return loss

    def _take_state(self, params: list[torch.Tensor], locals_: list[torch.Tensor]) -> None:
        """The inside state from the optimizer's (a first step, a load_state_dict, a
        parameter given new local data): local parts of the same tensors."""
        outside = self._optimizer.state
        self._outside, self._params, self._locals = outside, params, locals_
        self._inside = defaultdict(dict)
        for p, local in zip(params, locals_):
            if p in outside:
                self._inside[local] = {k: _local(v) for k, v in outside[p].items()}
        self._counted = _count(self._inside)

    def _sync_outside(self) -> None:
        """The step created state (these create it once, then update it in place): DTensors of it outside."""
        outside = self._outside
        for p, local in zip(self._params, self._locals):
            inside = self._inside.get(local)
            if inside is not None and (p not in outside or _changed(outside[p], inside)):
                outside[p] = {k: _like(p, local, v) for k, v in inside.items()}


def _identical(tensors: list[torch.Tensor], known: list[torch.Tensor]) -> bool:
    return len(tensors) == len(known) and all(map(operator.is_, tensors, known))


def _count(state: dict[torch.Tensor, dict[str, Any]]) -> tuple[int, int]:
    return len(state), sum(map(len, state.values()))


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _changed(outside: dict[str, Any], inside: dict[str, Any]) -> bool:
    """Whether the step added or replaced a state tensor (it updates in place otherwise)."""
    return outside.keys() != inside.keys() or any(
        _local(outside[k]) is not v for k, v in inside.items()
    )


def _like(param: torch.Tensor, local: torch.Tensor, value: Any) -> Any:
    """A state value as the optimizer outside sees it: per-element state as a DTensor of the
    parameter's layout over the same local tensor, anything else (a step count) as it is."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == local.shape:
        return DTensor(value, param._spec, requires_grad=False)
    return value
