"""When a unit's backward is done: one object with every rule, so that it can reduce and
reshard as early as is safe, and never before. Four signals, tried in this order (each's
reasons: docs/design.md, "When a unit's backward is done"): 1. its last gradient, a hook on each
unsharded parameter's accumulation; 2. its forward inputs' gradients, where (1) is unsafe or
never fires (frozen parameters, `reduce_scatter_unused_params`, a parameter once without
gradient); 3. its recomputation, under reentrant checkpointing; 4. the end of backward."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..param.sharded_param import ShardedParam
from ..unit.settings import UnitSettings

Inputs = tuple[tuple[Any, ...], dict[str, Any]]  # a forward's args and kwargs


class BackwardEnd:
    """Calls `done` once per backward of one unit, when it is done (while `in_backward()` holds)."""

    def __init__(
        self, params: list[ShardedParam], done: Callable[[], None],
        in_backward: Callable[[], bool], settings: UnitSettings,
    ) -> None:
        self._params = params
        self._done = done
        self._in_backward = in_backward  # the unit is in its backward, not done yet
        self._settings = settings  # its reduce_scatter_unused_params, read per forward
        self.hooked_in_forward = False  # this iteration's (a forward with grad)
        self._on_last_grad = False  # signal 1 this iteration, else 2
        self._grads_pending = 0
        self._inputs_pending = 0
        self._every_param_got_grads = True  # False forever once one did not (signal 2)
        # False for a unit whose parameters other units use (tied, see schedule/tied.py): their
        # uses may come after its inputs' gradients, so signal 4 ends it instead of 2.
        self.may_end_on_inputs = True
        # The unsharded parameters that carry the accumulation hook, by position (a new
        # layout makes new ones).
        self._hooked: list[nn.Parameter | None] = [None] * len(params)

    def hook_forward(self, args: Any, kwargs: dict[str, Any], recomputed: bool = False) -> Inputs:
        """A forward with grad, or a call `recomputed` by reentrant checkpointing (signal 3): end
        this backward with its last gradient, or its inputs' (the inputs returned carry a hook)."""
        self.hooked_in_forward = not recomputed  # a recomputation follows no hooked forward
        self._on_last_grad = self._can_end_on_last_grad()
        if not self._on_last_grad and self.may_end_on_inputs:
            args, kwargs, hooked = hook_inputs(args, kwargs, self.inputs_done)
            self._inputs_pending += hooked  # none: the end of backward finishes the unit
        return args, kwargs

    def _can_end_on_last_grad(self) -> bool:
        """Signal 1 applies; hooks parameters laid out anew."""
        if not self._every_param_got_grads or self._settings.reduce_scatter_unused_params:
            return False
        hooked = self._hooked
        for i, p in enumerate(self._params):
            param = p.unsharded
            if not param.requires_grad:
                return False
            if hooked[i] is not param:
                # Weakly: torch holds a parameter's hooks where the garbage collector cannot
                # see them, so a hook holding the unit would keep the model alive for good.
                param.register_post_accumulate_grad_hook(_weakly(self.grad_accumulated))
                hooked[i] = param
        return True

    def begin(self) -> None:
        """The unit's backward begins: count its gradients from here."""
        self._grads_pending = len(self._params)

    def grad_accumulated(self, _param: nn.Parameter) -> None:
        """Signal 1: run after each parameter's gradient is accumulated."""
        if self._on_last_grad and self._in_backward():
            self._grads_pending -= 1
            if not self._grads_pending:
                self._done()

    def inputs_done(self, *_grads: Any) -> None:
        """Signal 2: one forward's inputs' backward is done (a node hook: gradients unused)."""
        if self._inputs_pending > 0:
            self._inputs_pending -= 1
        if not self._inputs_pending and self._in_backward():
            self._done()

    def at_end_of_backward(self, unfinished: bool) -> None:
        """Signal 4 reached the unit (`unfinished`: its backward began and no hook ended
        it). A parameter then got no gradient, if signal 1 was awaited: use 2 from now on."""
        if unfinished and self._on_last_grad and self._params:
            self._every_param_got_grads = False
        self.forget()

    def forget(self) -> None:
        """The unit's backward finished or was abandoned: the next forward hooks anew. Not at the
        next forward: another unit's standalone forward (a chunked loss's head) may come first."""
        self._inputs_pending = 0
        self.hooked_in_forward = False


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
            return _InputsDone.apply(hook, x), kwargs, True  # type: ignore[no-untyped-call]
        view = x.view_as(x)
        view.grad_fn.register_hook(hook)  # type: ignore[union-attr]  # a view has a node
        return (view,), kwargs, True
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not where:
        return args, kwargs, False
    outs = _InputsDone.apply(hook, *(flat[i] for i in where))  # type: ignore[no-untyped-call]
    for i, out in zip(where, outs):
        flat[i] = out
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs, True


class _InputsDone(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs the hook."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[], None], *inputs: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


def _weakly(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """`method` as a hook that does not keep its object alive (nothing once it is gone)."""
    ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        if (bound := ref()) is not None:
            bound(param)

    return hook
