"""One iteration's state machine: each unit's phase (UnitState), and what its root owns across
the units of one model (Root): the forward order, the end-of-backward callback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

from ..comm import process_wide
from ..param.policies import MixedPrecisionPolicy
from ..param.sharded_param import ShardedParam
from ..unit.unit import CommContext, Unit
from .backward_done import BackwardEnd
from .phase import FORWARD, IDLE, POST_BACKWARD, PRE_BACKWARD, Phase


class Prefetch:
    """Which units a unit starts gathering once unsharded, to overlap its compute: the lists
    its settings give, else in backward the unit whose forward ended just before (the next to
    run backward), in forward with `implicit_forward_prefetch` the one that followed it."""

    def __init__(self) -> None:
        self.forward_index = -1  # the unit's place in this iteration's forward order
        self.ended_forward_before: tuple[UnitState, ...] = ()  # set as the unit's forward ends

    def in_forward(self, unit: UnitState, last_order: list[UnitState]) -> list[UnitState]:
        """The units to gather as `unit`'s forward begins (`last_order`: the last iteration's)."""
        settings = unit.settings
        if settings.forward_prefetch or not settings.implicit_forward_prefetch:
            return settings.forward_prefetch
        i = self.forward_index + 1
        return last_order[i : i + 1] if len(last_order) > i and last_order[i - 1] is unit else []

    def in_backward(self, unit: UnitState) -> Sequence[UnitState]:
        """The units to start gathering as `unit`'s backward begins."""
        explicit: list[UnitState] | None = unit.settings.backward_prefetch
        return self.ended_forward_before if explicit is None else explicit


class UnitState:
    """One unit's phase, and its settings (what FSDPModule's setters change)."""

    root: Root  # set at lazy init (the first forward), when `initialised` becomes True

    def __init__(self, modules: list[nn.Module], unit: Unit, mp: MixedPrecisionPolicy) -> None:
        self.modules = modules
        self.unit = unit
        self.settings = unit.settings  # see unit/settings.py
        self.phase = IDLE
        self.initialised = False
        # Parameters tied across units (see schedule/tied.py): the units whose parameters
        # this one uses and must see gathered, with those parameters; whether others use ours.
        self.borrowed_from: list[UnitState] = []
        self.borrowed_params: list[ShardedParam] = []
        self.lends = False
        self.comm = CommContext(unit.settings)  # the root's, after lazy init
        self.prefetch = Prefetch()
        self.modules_to_run: set[nn.Module] = set()  # in this forward (a list unit)
        self.backward_end = BackwardEnd(
            unit.params, self._backward_done, lambda: self.phase is PRE_BACKWARD, unit.settings
        )
        # What forward casts its floating-point inputs and outputs to (None: nothing).
        self.input_dtype = mp.param_dtype if mp.cast_forward_inputs else None
        self.output_dtype = mp.output_dtype

    @property
    def label(self) -> str:
        """For messages: the modules' class names, their fqn under the root once it ran."""
        return self.unit.label

    @property
    def is_root(self) -> bool:
        return self.initialised and self.root.state is self

    def refuse(self, phase: Phase) -> NoReturn:
        """A hook ran out of order (e.g. a forward inside the unit's forward): refuse `phase`."""
        raise RuntimeError(
            f"fsdp_compose: unit {self.label} on rank {self.unit.mesh.get_rank()} cannot go "
            f"from {self.phase.name} to {phase.name}: its hooks ran out of order."
        )

    def unshard(self, in_backward: bool = False) -> None:
        """Gather the unit (also finishes a prefetch's) and the units it borrows from."""
        if not in_backward or self.settings.unshard_in_backward:
            self.unit.unshard()
        for owner in self.borrowed_from:
            owner.unit.unshard()

    # -- the end of forward ----------------------------------------------------------------

    def finish_forward(self) -> None:
        if IDLE not in self.phase.next:
            self.refuse(IDLE)
        self.phase = IDLE
        root = self.root
        before = root.last_post_forward
        self.prefetch.ended_forward_before = () if before is None else (before,)
        root.last_post_forward = self
        if self.lends:
            # A borrower may still run in this forward: see schedule/tied.py, Root.end_forward.
            return
        if not torch.is_grad_enabled():
            self.unit.reshard()  # no backward can follow a forward without grad
        # None: True, but for the root.
        elif (after := self.settings.reshard_after_forward) or (after is None and not self.is_root):
            self.unit.reshard(keep_post_forward=True)

    def register_pre_backward(self, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for x in (output,) if isinstance(output, torch.Tensor) else tree_leaves(output):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                if (node := x.grad_fn) is not None:  # cheaper than a tensor hook, as early
                    node.register_prehook(self.pre_backward)
                else:
                    x.register_hook(self.pre_backward)

    # -- backward --------------------------------------------------------------------------

    def pre_backward(self, grad: Any) -> None:
        if self.phase is not PRE_BACKWARD:
            if PRE_BACKWARD not in self.phase.next:
                self.refuse(PRE_BACKWARD)
            self.phase = PRE_BACKWARD
            self.backward_end.begin()
            if not (root := self.root).final_callback_queued:
                root.final_callback_queued = True
                Variable._execution_engine.queue_callback(root.finish_backward)
        self.unshard(in_backward=True)
        if (observer := process_wide.observer) is not None:
            observer.backward_began(self)
        for other in self.prefetch.in_backward(self):
            # Not one whose backward is done already (gathered again for nothing).
            if other.settings.unshard_in_backward and other.phase is not POST_BACKWARD:
                self.comm.prefetch(other.unit)  # overlaps this unit's gradient computation

    def _backward_done(self) -> None:
        """Called by the BackwardEnd, in PRE_BACKWARD, and at the end of backward."""
        self.phase = POST_BACKWARD
        if (observer := process_wide.observer) is not None:
            observer.backward_done(self)
        # Freeing the parameters first keeps them and the reduce-scatter's buffers from
        # being allocated at once (the gradients live apart from the parameters' data).
        if self.settings.reshard_after_backward:
            self.unit.reshard()
        if self.settings.requires_gradient_sync:
            self.comm.reduce(self.unit)  # without sync, the gradients wait in unsharded form

    def finish_backward(self) -> None:
        """Signal 4 (backward_done.py): finish the unit if no hook did, or if it holds gradients of
        backwards without sync while not run this time; then IDLE."""
        unfinished = self.phase is PRE_BACKWARD
        self.backward_end.at_end_of_backward(unfinished)
        if self.phase is not POST_BACKWARD:
            if unfinished or self.unit.has_unsharded_grads():
                self._backward_done()
            elif self.settings.reshard_after_backward:
                self.unit.reshard()
        self.phase = IDLE

    def forget_iteration(self) -> None:
        """IDLE and resharded, an unfinished backward's gradients dropped (finished ones' kept)."""
        self.unit.reshard()
        self.unit.discard_backward()
        self.phase = IDLE
        self.modules_to_run.clear()
        self.backward_end.forget()

    def reset_iter_state(self) -> None:
        if self.initialised:
            self.root.reset()
        else:
            self.forget_iteration()


class Root:
    """Iteration-wide state of one root (the unit whose module contains all others, found at
    the first forward: see hooks.py) and the units under it, in module order."""

    def __init__(self, state: UnitState, states: list[UnitState]) -> None:
        self.state = state
        self.states = states
        self.forward_root: UnitState | None = None  # the unit whose forward encloses the others'
        self.final_callback_queued = False
        # This iteration's units in the order their forwards began (implicit forward
        # prefetch follows the last iteration's), and the unit whose forward ended last
        # (backward prefetches it from the unit whose forward ended next).
        self.forward_order: list[UnitState] = []
        self.last_forward_order: list[UnitState] = []
        self.last_post_forward: UnitState | None = None
        # Units prefetched in this forward: any that did not run are resharded at its end.
        self.forward_prefetched: list[UnitState] = []

    def begin_forward(self, state: UnitState) -> None:
        """`state`'s forward encloses every other of this iteration: start the iteration."""
        self.forward_root = state
        for s in self.states:  # what changed since the last iteration
            s.unit.adopt_registered()
        settings = self.state.settings
        event, settings.post_optim_event = settings.post_optim_event, None
        if (side := state.unit.streams) is not None:
            side.follow_compute(event)  # gathers see the optimizer's step
        elif event is not None:
            event.wait()  # the current stream, which gathers, waits for the optimizer
        if self.forward_order:
            self.last_forward_order = self.forward_order
        self.forward_order, self.last_post_forward = [], None

    def end_forward(self, output: Any) -> None:
        """The enclosing forward returned `output`."""
        self.forward_root = None
        ran = set(self.forward_order)
        for s in self.forward_prefetched:  # prefetched, then not run (the order changed)
            if s not in ran:
                s.unit.reshard()
        self.forward_prefetched.clear()
        no_backward = not torch.is_grad_enabled()
        for s in self.states:
            if s.phase is FORWARD:
                # A list unit whose modules did not all run (e.g. a head skipped by a chunked
                # loss) ends its forward with the enclosing one: its pre-backward hook goes on
                # the enclosing forward's output.
                s.modules_to_run.clear()
                s.register_pre_backward(output)
                s.finish_forward()
            if s.lends and no_backward:  # lenders keep their parameters: free them now
                s.unit.reshard()

    def finish_backward(self) -> None:
        """End of backward: finish every unit no hook finished, in module order (the same
        on every rank), wait for the reductions, commit the gradients, go back to IDLE."""
        for s in self.states:
            s.finish_backward()
        # The root unit's: share_comm_ctx may replace it at any time, so read, never copied.
        self.state.comm.finish_reductions()
        for s in self.states:  # see Note [gradients per backward] in unit/grad_ledger.py
            s.unit.commit_backward()
        self.final_callback_queued = False

    def finalize_backward(self) -> None:
        """FSDPModule.finalize_backward: reduce what backwards without sync left, as at the end."""
        # A unit awaits its backward if a forward with grad ran and its backward has not finished.
        if bad := [s.label for s in self.states
                   if s.phase is not IDLE or s.backward_end.hooked_in_forward]:
            raise RuntimeError(
                f"finalize_backward: units {bad} are between a forward and its backward; "
                "call it after the step's backward passes."
            )
        self.finish_backward()

    def reset(self) -> None:
        """Forget the current iteration: forget_iteration on every unit, nothing pending."""
        for s in self.states:
            s.forget_iteration()
        self.forward_root = None
        self.final_callback_queued = False
        self.forward_prefetched.clear()


# How a module's unit state is found: fully_shard attaches it to each module of the unit, and
# every reader asks here (in the module's __dict__, where an attribute lookup or a deep copy
# does not reach it by accident).
_STATE_ATTR = "_fsdp_compose_state"


def attach(module: nn.Module, state: UnitState) -> None:
    module.__dict__[_STATE_ATTR] = state


def state_of(module: nn.Module) -> UnitState | None:
    """The unit state fully_shard attached to `module`, if any."""
    state: UnitState | None = module.__dict__.get(_STATE_ATTR)
    return state
