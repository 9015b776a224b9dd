"""Forward and backward hooks, and the per-unit phase machine that orders them.

A unit is unsharded in its forward pre-hook and resharded in its forward post-hook (unless
it keeps its parameters for backward). Pre-hooks on the forward outputs' backward nodes
unshard it again before its backward. Once the unit's backward is done it reduces its
gradients and reshards: when its last gradient is accumulated, or when the backward of
its forward inputs ran (see _backward_done.py). A callback queued on the autograd engine
ends every backward: it finishes what no hook finished and resets the iteration.
"""

from __future__ import annotations

import enum
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves, tree_map_only

from ._agreement import check_ranks_agree
from ._backward_done import hook_grad_accumulation, hook_inputs
from ._comm_context import CommContext
from ._policies import MixedPrecisionPolicy
from ._unit import Unit

STATE_ATTR = "_fsdp_compose_state"


class Phase(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


# The phases each phase may go to. Tuples: their membership test compares identities,
# while a set or dict would hash the enum member with a Python-level __hash__.
_NEXT = (
    (Phase.IDLE, (Phase.FORWARD, Phase.PRE_BACKWARD)),
    (Phase.FORWARD, (Phase.IDLE, Phase.FORWARD)),  # FORWARD again: another module of a list unit
    (Phase.PRE_BACKWARD, (Phase.PRE_BACKWARD, Phase.POST_BACKWARD)),
    # A part of the graph whose inputs did not require grad reaches the unit again after
    # its reduction; it is unsharded and reduced once more (grads accumulate correctly).
    (Phase.POST_BACKWARD, (Phase.PRE_BACKWARD,)),
)
for _phase, _next in _NEXT:
    _phase.next = _next  # type: ignore[attr-defined]
# The members as module globals, which the hooks read at every call: a member looked up on
# its enum class costs as much as a function call (Python 3.11).
IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = Phase


def state_of(module: nn.Module) -> UnitState | None:
    """The unit state fully_shard attached to `module`, if any."""
    return module.__dict__.get(STATE_ATTR)


@dataclass
class IterContext:
    """What a root shares with every unit under it, for one iteration at a time."""

    root: UnitState
    states: list[UnitState]  # every unit under the root, in module order
    forward_root: UnitState | None = None  # the unit whose forward encloses the others'
    final_callback_queued: bool = False
    # This iteration's units in the order their forwards began (implicit forward prefetch
    # follows the last iteration's), and the unit whose forward ended last (backward
    # prefetches it from the unit whose forward ended next).
    forward_order: list[UnitState] = field(default_factory=list)
    last_forward_order: list[UnitState] = field(default_factory=list)
    last_post_forward: UnitState | None = None
    # Units prefetched in this forward: any that did not run are resharded at its end.
    forward_prefetched: list[UnitState] = field(default_factory=list)


@dataclass(eq=False)
class UnitState:
    """One unit's hooks and phase. Its flags are what FSDPModule's setters change."""

    modules: list[nn.Module]
    unit: Unit
    # None: decided at lazy init (False for the root). An int group size is True here plus
    # the unit's post-forward mesh.
    reshard_after_forward: bool | None
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    requires_gradient_sync: bool = True
    label: str = ""
    phase: Phase = IDLE
    ctx: IterContext | None = None
    # id -> weak reference of each parameter as it was before sharding, to recognise a
    # parameter tied to one outside the unit when an enclosing module is annotated.
    original_params: dict[int, weakref.ref[nn.Parameter]] = field(default_factory=dict)
    comm: CommContext = field(default_factory=CommContext)  # the root's, after lazy init
    # Units to start gathering once this one is unsharded, in forward and in backward
    # (explicit, set_modules_to_*_prefetch). Without, backward prefetches the unit whose
    # forward ended before this one's, and forward (if `implicit_forward_prefetch`) the
    # unit whose forward began after this one's in the last iteration.
    forward_prefetch: list[UnitState] = field(default_factory=list)
    backward_prefetch: list[UnitState] | None = None
    implicit_forward_prefetch: bool = False
    post_optim_event: Any = None  # a torch.Event the next forward's gathers wait for
    _forward_index: int = -1  # in ctx.forward_order
    _ended_forward_before: tuple[UnitState, ...] = ()  # implicit backward prefetch
    _modules_to_run: set[nn.Module] = field(default_factory=set)
    # How this iteration's backward of the unit ends (see _ends_on_last_grad_now): with its
    # parameters' last gradient (counting down those not accumulated yet), or with the
    # backward nodes of its forward inputs (counting down those not run yet).
    _hooked_in_forward: bool = False  # this iteration's (a forward with grad)
    _ends_on_last_grad: bool = False
    _grads_pending: int = 0
    _pending_post_backward: int = 0
    # False once a backward ended before the unit's last gradient came (a parameter was
    # unused): its backward ends with its inputs' nodes from then on.
    _every_param_got_grads: bool = True

    def __post_init__(self) -> None:
        # What forward casts its floating-point inputs and outputs to (None: nothing), read
        # per call.
        mp = self.mp_policy
        self._input_dtype = mp.param_dtype if mp.cast_forward_inputs else None
        self._output_dtype = mp.output_dtype
        # The unsharded parameters that carry _grad_accumulated, by position in the unit
        # (a new layout makes new ones).
        self._hooked_params: list[nn.Parameter | None] = [None] * len(self.unit.params)

    def install_hooks(self) -> None:
        for module in self.modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            # Also called when forward raised, to undo what pre_forward did.
            module.register_forward_hook(self.post_forward, always_call=True)

    def owned_before_sharding(self, param: nn.Parameter) -> bool:
        ref = self.original_params.get(id(param))
        return ref is not None and ref() is param

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    def _bad_transition(self, phase: Phase) -> str:
        # The hooks assert `phase in self.phase.next` inline (a call per hook costs more).
        return (
            f"fsdp_compose unit {self.label} on rank {self.unit.mesh.get_rank()}: "
            f"{self.phase.name} -> {phase.name}"
        )

    def lazy_init(self) -> None:
        """Make this unit the root of every unit below it, on its first forward."""
        if self.ctx is not None:
            return
        if len(self.modules) > 1:
            names = ", ".join(type(m).__name__ for m in self.modules)
            raise RuntimeError(
                f"fully_shard([{names}]) ran forward before any enclosing unit: a root must be "
                "one module. Call fully_shard(model) on the module that contains them all."
            )
        states: list[UnitState] = []
        for fqn, module in self.modules[0].named_modules():
            state = state_of(module)
            if state is None or any(state is s for s in states):
                continue
            if state is not self and state.ctx is not None:
                raise RuntimeError(
                    f"fully_shard: the unit at {fqn!r} ({type(module).__name__}) already ran "
                    f"forward as a root before its enclosing unit "
                    f"{type(self.modules[0]).__name__}. Run forward through the outermost "
                    "annotated module first."
                )
            state.label = state.unit.label = fqn or f"<root {type(module).__name__}>"
            states.append(state)
        problem = None
        for state in states:
            state.unit.adopt_registered()
            if problem is None and (meta := [p.fqn for p in state.unit.params if p.is_meta]):
                problem = (
                    f"fsdp_compose: unit {state.label} on rank {self.unit.mesh.get_rank()} ran "
                    f"forward with parameters on the meta device ({', '.join(meta)}). "
                    "Initialise them first: fsdp_compose.materialize(model), or "
                    "model.to_empty(device=...) and your own initialisation."
                )
        check_ranks_agree(states, self.unit.mesh, problem)
        if problem is not None:  # a one-rank mesh has no gather to raise it
            raise RuntimeError(problem)
        if changed := [s.label for s in states if s is not self and s.comm.changed_by]:
            raise ValueError(
                f"fsdp_compose: the communication bounds were set on {changed}, which are "
                f"not roots: their root {self.label} runs them. Call the setter on the root."
            )
        ctx = IterContext(root=self, states=states)
        for state in states:
            state.ctx = ctx
            state.comm = self.comm
            if state.reshard_after_forward is None:
                # The root's parameters would be freed and gathered again at once.
                state.reshard_after_forward = state is not self

    # -- forward ---------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if torch.compiler.is_dynamo_compiling():
            return _run_eagerly(self.pre_forward, module, args, kwargs)
        if self.ctx is None:
            self.lazy_init()
        if self._input_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self._input_dtype)
        if _current_graph_task_id() != -1:  # in backward
            # Activation checkpointing re-runs forward inside backward. After a forward with
            # grad (non-reentrant checkpointing) the unit's hooks own its backward: only
            # make sure the parameters are there. After one without (reentrant: the
            # recomputation's own backward follows at once) its backward begins here.
            if not self._hooked_in_forward and torch.is_grad_enabled():
                self._pre_backward(None)
                args, kwargs = self._hook_backward_end(args, kwargs)  # at every call
            self.unit.unshard()
            return args, kwargs
        if self.ctx.final_callback_queued:
            # The last backward raised before it finished: forget it, keep what earlier
            # backwards accumulated, and start this iteration from a clean state.
            self.ctx.root.reset_iter_state()
        ctx = self.ctx
        if self.phase is IDLE:
            self._modules_to_run = set(self.modules)
            if ctx.forward_root is None:
                ctx.forward_root = self
                for state in ctx.states:  # what changed since the last iteration
                    state.unit.adopt_registered()
                    state._hooked_in_forward = False
                event, ctx.root.post_optim_event = ctx.root.post_optim_event, None
                if (side := self.unit.streams) is not None:
                    side.follow_compute(event)  # gathers see the optimizer's step
                elif event is not None:
                    event.wait()  # the current stream, which gathers, waits for the optimizer
                if ctx.forward_order:
                    ctx.last_forward_order = ctx.forward_order
                ctx.forward_order, ctx.last_post_forward = [], None
            self._forward_index = len(ctx.forward_order)
            ctx.forward_order.append(self)
        assert FORWARD in self.phase.next, self._bad_transition(FORWARD)
        self.phase = FORWARD
        self.unit.unshard()  # also finishes a prefetch's gather
        if self.forward_prefetch or self.implicit_forward_prefetch:
            for other in self._forward_prefetch_targets():
                self.comm.prefetch(other.unit)  # overlaps this unit's compute; waited for there
                ctx.forward_prefetched.append(other)
        if torch.is_grad_enabled():
            self._hooked_in_forward = True
            args, kwargs = self._hook_backward_end(args, kwargs)
        return args, kwargs

    def _forward_prefetch_targets(self) -> list[UnitState]:
        if self.forward_prefetch or not self.implicit_forward_prefetch:
            return self.forward_prefetch
        last, i = self.ctx.last_forward_order, self._forward_index + 1
        return last[i : i + 1] if len(last) > i and last[i - 1] is self else []

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return _run_eagerly(self.post_forward, module, args, output)
        # nn.Module calls this hook with output None when forward raised, from inside its
        # `except` (a forward returning None while its caller handles an exception reads
        # as failed too: nothing can run backward through it, and the unit is resharded).
        if output is None and sys.exc_info()[1] is not None:
            self._after_failed_forward(module)
            return None
        in_backward = _current_graph_task_id() != -1  # recomputation: see pre_forward
        if not in_backward:
            self._modules_to_run.discard(module)
            self._register_pre_backward(output)
        if self._output_dtype is not None:
            output = _cast_floating(output, self._output_dtype)
        if in_backward or self._modules_to_run:
            return output  # recomputation, or a list unit waiting for its other modules
        self._finish_forward()
        if self.ctx.forward_root is self:
            self.ctx.forward_root = None
            self._reshard_unused_prefetches()
            # A list unit whose modules did not all run (e.g. a head skipped by a chunked
            # loss) still ends its forward with the forward that enclosed it.
            for state in self.ctx.states:
                if state.phase is FORWARD:
                    state._modules_to_run.clear()
                    state._register_pre_backward(output)
                    state._finish_forward()
        return output

    def _reshard_unused_prefetches(self) -> None:
        """Units prefetched in this forward that then did not run (the order changed)."""
        ran = set(self.ctx.forward_order)
        for state in self.ctx.forward_prefetched:
            if state not in ran:
                state.unit.reshard()
        self.ctx.forward_prefetched.clear()

    def _after_failed_forward(self, module: nn.Module) -> None:
        """`module`'s forward raised: undo what its pre-hook did; if it was the forward
        enclosing the others, undo the whole iteration's forward."""
        if self.phase is not FORWARD or module not in self._modules_to_run or _in_backward():
            return  # not a forward of ours in progress (e.g. a recomputation in backward)
        if self.ctx.forward_root is self:
            self.ctx.root.reset_iter_state()
        else:
            self._modules_to_run.discard(module)
            if not self._modules_to_run:
                self.unit.reshard()
                self.phase = IDLE

    def _finish_forward(self) -> None:
        assert IDLE in self.phase.next, self._bad_transition(IDLE)
        self.phase = IDLE
        ctx = self.ctx
        before = ctx.last_post_forward
        self._ended_forward_before = () if before is None else (before,)
        ctx.last_post_forward = self
        if not torch.is_grad_enabled():
            self.unit.reshard()  # no backward can follow a forward without grad
        elif self.reshard_after_forward:
            self.unit.reshard(keep_post_forward=True)

    def _hook_backward_end(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Make this iteration's backward of the unit end with its last gradient, or with
        the backward of its inputs (returned in their place)."""
        self._ends_on_last_grad = self._ends_on_last_grad_now()
        if not self._ends_on_last_grad:
            args, kwargs, hooked = hook_inputs(args, kwargs, self.post_backward)
            self._pending_post_backward += hooked  # else the end-of-backward callback
        return args, kwargs

    def _ends_on_last_grad_now(self) -> bool:
        """Whether this backward of the unit can end with its last gradient (see
        _backward_done.py): when all its parameters require grad, earlier backwards gave
        them all one, and ranks do not leave different ones without gradient
        (reduce_scatter_unused_params), which would have them reduce at different points.
        Hooks parameters laid out anew."""
        if not self._every_param_got_grads or self.unit.reduce_scatter_unused_params:
            return False
        return hook_grad_accumulation(self.unit.params, self._hooked_params, self._grad_accumulated)

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

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.phase is not PRE_BACKWARD:
            assert PRE_BACKWARD in self.phase.next, self._bad_transition(PRE_BACKWARD)
            self.phase = PRE_BACKWARD
            self._grads_pending = len(self.unit.params)
            if not self.ctx.final_callback_queued:
                self._queue_final_callback()
        if self.unshard_in_backward:
            self.unit.unshard()  # also finishes a prefetch's gather
        targets = self.backward_prefetch
        for other in self._ended_forward_before if targets is None else targets:
            # Not one whose backward is done already (gathered again for nothing).
            if other.unshard_in_backward and other.phase is not POST_BACKWARD:
                self.comm.prefetch(other.unit)  # overlaps this unit's gradient computation

    def _grad_accumulated(self, _param: nn.Parameter) -> None:
        """Run after each parameter's gradient is accumulated: the unit's backward is done
        with the last (when it ends so, see _ends_on_last_grad_now)."""
        if self._ends_on_last_grad and self.phase is PRE_BACKWARD:
            self._grads_pending -= 1
            if not self._grads_pending:
                self.phase = POST_BACKWARD
                self._reduce_and_reshard()

    def post_backward(self, *_grads: Any) -> None:
        """Run once the unit's backward is done: every forward's input node has run (as a
        hook of its backward node, which passes its gradients: unused)."""
        if self._pending_post_backward > 0:
            self._pending_post_backward -= 1
        if self._pending_post_backward or self.phase is not PRE_BACKWARD:
            return
        assert POST_BACKWARD in self.phase.next, self._bad_transition(POST_BACKWARD)
        self.phase = POST_BACKWARD
        self._reduce_and_reshard()

    def _reduce_and_reshard(self) -> None:
        # Freeing the parameters first keeps them and the reduce-scatter's buffers from
        # being allocated at once (the gradients live apart from the parameters' data).
        if self.reshard_after_backward:
            self.unit.reshard()
        if self.requires_gradient_sync:
            self.comm.reduce(self.unit)  # without sync, the gradients wait in unsharded form

    def _queue_final_callback(self) -> None:
        self.ctx.final_callback_queued = True
        Variable._execution_engine.queue_callback(self.ctx.root.finish_backward)

    def finish_backward(self) -> None:
        """End of backward, on the root: finish every unit no hook finished, in module order
        (the same on every rank), and start the next iteration from IDLE."""
        for state in self.ctx.states:
            if state.phase is not POST_BACKWARD:
                # Reached by no hook (inputs without grad, parameters without a gradient),
                # or holding gradients from backwards without sync while not run this time.
                if state.phase is PRE_BACKWARD and state._ends_on_last_grad and state.unit.params:
                    state._every_param_got_grads = False  # a parameter got no gradient
                if state.phase is PRE_BACKWARD or state.unit.has_unsharded_grads():
                    state._reduce_and_reshard()
                elif state.reshard_after_backward:
                    state.unit.reshard()
            state.phase = IDLE
            state._pending_post_backward = 0
        self.comm.finish_reductions()
        for state in self.ctx.states:  # see Note [gradients per backward] in _param.py
            state.unit.commit_backward()
        self.ctx.final_callback_queued = False

    def reset_iter_state(self) -> None:
        """Forget the current iteration: every unit IDLE and resharded, the gradients of an
        unfinished backward dropped (those of finished ones kept), nothing pending."""
        states = self.ctx.states if self.ctx is not None else [self]
        for state in states:
            state.unit.reshard()
            state.unit.discard_backward()
            state.phase = IDLE
            state._modules_to_run.clear()
            state._pending_post_backward = 0
        if self.ctx is not None:
            self.ctx.forward_root = None
            self.ctx.final_callback_queued = False
            self.ctx.forward_prefetched.clear()


@torch.compiler.disable
def _run_eagerly(hook: Callable[..., Any], *args: Any) -> Any:
    """Call `hook` eagerly. The module hooks call this first thing when torch.compile
    traces them (dynamo reads is_dynamo_compiling() as True): they communicate and resize
    storage, which graphs cannot hold, so compilation breaks the graph around them. Eager
    calls go straight on: a wrapper around every hook would cost more than its bookkeeping."""
    return hook(*args)


# The autograd engine's graph task on this thread, -1 outside backward (the hot hooks call
# it directly, a function call less).
_current_graph_task_id = torch._C._current_graph_task_id


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return _current_graph_task_id() != -1


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree
    )
