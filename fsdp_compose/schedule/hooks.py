"""A unit's forward and backward hooks, which move it through its phases (phase.py).

A unit is unsharded in its forward pre-hook and resharded in its forward post-hook (unless
it keeps its parameters for backward). Pre-hooks on the forward outputs' backward nodes
unshard it again before its backward. Once its backward is done (see backward_done.py) it
reduces its gradients and reshards. What spans the units of one model (the forward order,
the end-of-backward callback) is the root's: see root.py.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..comm import observer as _observer
from ..param.policies import MixedPrecisionPolicy, cast_floating
from ..param.sharded_param import ShardedParam
from ..unit.unit import Unit
from .backward_done import BackwardEnd
from .comm_context import CommContext
from .eager import run_eagerly
from .phase import (
    FORWARD,
    IDLE,
    POST_BACKWARD,
    PRE_BACKWARD,
    Phase,
    current_graph_task_id,
    in_backward,
)
from .prefetch import Prefetch
from .root import Root
from .unmanaged import stop_watching


class UnitState:
    """One unit's hooks, phase and settings (what FSDPModule's setters change)."""

    root: Root[UnitState]  # set at lazy init (the first forward), when `initialised` becomes True

    def __init__(
        self, modules: list[nn.Module], unit: Unit, reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.unit = unit
        # None: decided at lazy init (False for the root). An int group size is True here
        # plus the unit's post-forward mesh.
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.requires_gradient_sync = True
        self.phase = IDLE
        self.initialised = False
        # Parameters tied across units (see schedule/tied.py): the units whose parameters this one
        # uses and must see gathered, with those parameters; whether others use ours.
        self.borrowed_from: list[UnitState] = []
        self.borrowed_params: list[ShardedParam] = []
        self.lends = False
        self.comm = CommContext()  # the root's, after lazy init
        self.post_optim_event: Any = None  # read by the root: its next forward's gathers wait
        self.prefetch: Prefetch[UnitState] = Prefetch()
        self._modules_to_run: set[nn.Module] = set()
        # The setters give every part (mesh) of a unit the same value: the first's answers.
        reducer = unit.parts[0].reducer
        self.backward_end = BackwardEnd(
            unit.params, self._backward_done, lambda: self.phase is PRE_BACKWARD,
            lambda: reducer.reduce_scatter_unused_params,
        )
        # What forward casts its floating-point inputs and outputs to (None: nothing).
        self._input_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        self._output_dtype = mp_policy.output_dtype

    def install_hooks(self) -> None:
        for module in self.modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            # Also called when forward raised, to undo what pre_forward did.
            module.register_forward_hook(self.post_forward, always_call=True)

    def _unshard_lenders(self) -> None:
        for owner in self.borrowed_from:
            owner.unit.unshard()

    @property
    def label(self) -> str:
        """For messages: the modules' class names, their fqn under the root once it ran."""
        return self.unit.label

    @property
    def awaits_backward(self) -> bool:
        """Whether a forward with grad ran and its backward has not finished."""
        return self.phase is not IDLE or self.backward_end.hooked_in_forward

    @property
    def is_root(self) -> bool:
        return self.initialised and self.root.state is self

    def _refuse(self, phase: Phase) -> NoReturn:
        """A hook ran out of order (e.g. forward run again inside a forward of the same
        unit, or a backward hook without a forward): the move to `phase` is not allowed."""
        raise RuntimeError(
            f"fsdp_compose: unit {self.label} on rank {self.unit.mesh.get_rank()} cannot go "
            f"from {self.phase.name} to {phase.name}: its hooks ran out of order."
        )

    # -- forward ---------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if torch.compiler.is_dynamo_compiling():
            return run_eagerly(self.pre_forward, module, args, kwargs)  # type: ignore[no-any-return]
        if not self.initialised:
            Root.of(self)  # the first forward: this unit is the root of all below it
            stop_watching()  # for parameters no unit manages: see schedule/unmanaged.py
        if self._input_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), self._input_dtype)
        if current_graph_task_id() != -1:
            return self._pre_recomputation(args, kwargs)
        root = self.root
        if root.final_callback_queued:
            # The last backward raised before it finished: forget it, keep what earlier
            # backwards accumulated, and start this iteration from a clean state.
            root.reset()
        if self.phase is IDLE:
            self._modules_to_run = set(self.modules)
            if root.forward_root is None:
                root.begin_forward(self)
            self.prefetch.forward_index = len(root.forward_order)
            root.forward_order.append(self)
        if FORWARD not in self.phase.next:
            self._refuse(FORWARD)
        self.phase = FORWARD
        self.unit.unshard()  # also finishes a prefetch's gather
        if self.borrowed_from:
            self._unshard_lenders()
        if (prefetch := self.prefetch).forward or prefetch.implicit_forward:
            for other in prefetch.in_forward(self, root.last_forward_order):
                self.comm.prefetch(other.unit)  # overlaps this unit's compute; waited for there
                root.forward_prefetched.append(other)
        if torch.is_grad_enabled():
            args, kwargs = self.backward_end.hook_forward(args, kwargs)
        return args, kwargs

    def _pre_recomputation(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Activation checkpointing re-runs forward inside backward. After a forward with
        grad (non-reentrant checkpointing) the unit's hooks own its backward: only make
        sure the parameters are there. After one without (reentrant: the recomputation's
        own backward follows at once) its backward begins here."""
        if not self.backward_end.hooked_in_forward and torch.is_grad_enabled():
            self._pre_backward(None)
            args, kwargs = self.backward_end.hook_recomputation(args, kwargs)
        self.unit.unshard()
        if self.borrowed_from:
            self._unshard_lenders()
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return run_eagerly(self.post_forward, module, args, output)
        # nn.Module calls this hook with output None when forward raised, from inside its
        # `except` (a forward returning None while its caller handles an exception reads
        # as failed too: nothing can run backward through it, and the unit is resharded).
        if output is None and sys.exc_info()[1] is not None:
            self._after_failed_forward(module)
            return None
        recomputing = current_graph_task_id() != -1  # in backward: see pre_forward
        if not recomputing:
            self._modules_to_run.discard(module)
            self._register_pre_backward(output)
        if self._output_dtype is not None:
            output = cast_floating(output, self._output_dtype)
        if recomputing:
            return output  # see pre_forward
        if self._modules_to_run and self.root.forward_root is not self:
            # A list unit waiting for its other modules inside the enclosing forward. (A
            # module of it called on its own, e.g. a head by a chunked loss, is the
            # enclosing forward: its forward ends here.)
            return output
        self._finish_forward()
        if self.root.forward_root is self:
            self.root.end_forward(output)
        return output

    def end_partial_forward(self, output: Any) -> None:
        """The enclosing forward ended: end this unit's forward if some of its modules did
        not run (their pre-backward hooks go on the enclosing forward's output)."""
        if self.phase is FORWARD:
            self._modules_to_run.clear()
            self._register_pre_backward(output)
            self._finish_forward()

    def _after_failed_forward(self, module: nn.Module) -> None:
        """`module`'s forward raised: undo what its pre-hook did; if it was the forward
        enclosing the others, undo the whole iteration's forward."""
        if self.phase is not FORWARD or module not in self._modules_to_run or in_backward():
            return  # not a forward of ours in progress (e.g. a recomputation in backward)
        if self.root.forward_root is self:
            self.root.reset()
        else:
            self._modules_to_run.discard(module)
            if not self._modules_to_run:
                self.unit.reshard()
                self.phase = IDLE

    def _finish_forward(self) -> None:
        if IDLE not in self.phase.next:
            self._refuse(IDLE)
        self.phase = IDLE
        root = self.root
        before = root.last_post_forward
        self.prefetch.ended_forward_before = () if before is None else (before,)
        root.last_post_forward = self
        if self.lends:
            return  # a borrower may still run in this forward: see schedule/tied.py and Root.end_forward
        if not torch.is_grad_enabled():
            self.unit.reshard()  # no backward can follow a forward without grad
        elif self.reshard_after_forward:
            self.unit.reshard(keep_post_forward=True)

    def _register_pre_backward(self, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for x in (output,) if isinstance(output, torch.Tensor) else tree_leaves(output):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                if (node := x.grad_fn) is not None:  # cheaper than a tensor hook, as early
                    node.register_prehook(self._pre_backward)
                else:
                    x.register_hook(self._pre_backward)

    # -- backward --------------------------------------------------------------------------

    def _pre_backward(self, grad: Any) -> None:
        if self.phase is not PRE_BACKWARD:
            if PRE_BACKWARD not in self.phase.next:
                self._refuse(PRE_BACKWARD)
            self.phase = PRE_BACKWARD
            self.backward_end.begin()
            if not self.root.final_callback_queued:
                self.root.queue_final_callback()
        if self.unshard_in_backward:
            self.unit.unshard()  # also finishes a prefetch's gather
        if self.borrowed_from:
            self._unshard_lenders()
        if (observer := _observer.current) is not None:
            observer.backward_began(self)
        for other in self.prefetch.in_backward():
            # Not one whose backward is done already (gathered again for nothing).
            if other.unshard_in_backward and other.phase is not POST_BACKWARD:
                self.comm.prefetch(other.unit)  # overlaps this unit's gradient computation

    def _backward_done(self) -> None:
        """Called by the BackwardEnd, in PRE_BACKWARD: reduce and reshard."""
        self.phase = POST_BACKWARD
        self._reduce_and_reshard()

    def _reduce_and_reshard(self) -> None:
        # Freeing the parameters first keeps them and the reduce-scatter's buffers from
        # being allocated at once (the gradients live apart from the parameters' data).
        if self.reshard_after_backward:
            self.unit.reshard()
        if self.requires_gradient_sync:
            self.comm.reduce(self.unit)  # without sync, the gradients wait in unsharded form

    def finish_backward(self) -> None:
        """The end of backward reached this unit (signal 4 in schedule/backward_done.py): finish it
        if no hook did, or if it holds gradients from backwards without sync while not run
        this time; then IDLE."""
        unfinished = self.phase is PRE_BACKWARD
        self.backward_end.at_end_of_backward(unfinished)
        if self.phase is not POST_BACKWARD:
            if unfinished or self.unit.has_unsharded_grads():
                self._reduce_and_reshard()
            elif self.reshard_after_backward:
                self.unit.reshard()
        self.phase = IDLE

    def forget_iteration(self) -> None:
        """IDLE and resharded, the gradients of an unfinished backward dropped."""
        self.unit.reshard()
        self.unit.discard_backward()
        self.phase = IDLE
        self._modules_to_run.clear()
        self.backward_end.forget()

    def reset_iter_state(self) -> None:
        if self.initialised:
            self.root.reset()
        else:
            self.forget_iteration()
