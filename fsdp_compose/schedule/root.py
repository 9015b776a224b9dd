"""The root: the unit whose module contains all others, and what it owns for them across
an iteration: the forward order, the end-of-backward callback, the first forward's checks.

A root is made at the first forward of the outermost annotated module (lazy init); every
unit under it then points to it. Units hold only their own state.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from torch import nn
from torch.autograd import Variable

from ..unit.unit import Unit
from .agreement import check_ranks_agree
from .comm_context import CommContext
from .state import state_of


class Member(Protocol):
    """What a root reads and calls of the units under it (see UnitState in schedule/hooks.py)."""

    modules: list[nn.Module]
    unit: Unit

    @property
    def label(self) -> str: ...
    root: Root[Any]
    comm: CommContext
    post_optim_event: Any
    initialised: bool
    reshard_after_forward: bool | None
    lends: bool

    def end_partial_forward(self, output: Any) -> None: ...
    def finish_backward(self) -> None: ...
    def forget_iteration(self) -> None: ...
    @property
    def awaits_backward(self) -> bool: ...


S = TypeVar("S", bound=Member)


class Root(Generic[S]):
    """Iteration-wide state of one root and the units under it (in module order)."""

    def __init__(self, state: S, states: list[S]) -> None:
        self.state = state
        self.states = states
        self.forward_root: S | None = None  # the unit whose forward encloses the others'
        self.final_callback_queued = False
        # This iteration's units in the order their forwards began (implicit forward
        # prefetch follows the last iteration's), and the unit whose forward ended last
        # (backward prefetches it from the unit whose forward ended next).
        self.forward_order: list[S] = []
        self.last_forward_order: list[S] = []
        self.last_post_forward: S | None = None
        # Units prefetched in this forward: any that did not run are resharded at its end.
        self.forward_prefetched: list[S] = []

    @property
    def comm(self) -> CommContext:
        """The root unit's communication context: share_comm_ctx may replace it at any
        time, so it is read from the unit, never copied."""
        return self.state.comm

    @classmethod
    def of(cls, state: S) -> Root[S]:
        """Make `state`'s unit the root of every unit below it (its first forward): label
        them, check the model on this rank and then across ranks, point them to the root
        and its comm context."""
        modules = state.modules
        if len(modules) > 1:
            names = ", ".join(type(m).__name__ for m in modules)
            raise RuntimeError(
                f"fully_shard([{names}]) ran forward before any enclosing unit: a root must be "
                "one module. Call fully_shard(model) on the module that contains them all."
            )
        states = _units_under(state)
        for s in states:
            s.unit.adopt_registered()
        problem = _local_problem(states)
        check_ranks_agree([s.unit for s in states], state.unit.mesh, problem)
        if problem is not None:  # a one-rank mesh has no gather to raise it
            raise RuntimeError(problem)
        if changed := [s.label for s in states if s is not state and s.comm.changed_by]:
            raise ValueError(
                f"fsdp_compose: the communication bounds were set on {changed}, which are "
                f"not roots: their root {state.label} runs them. Call the setter on the root."
            )
        root = cls(state, states)
        for s in states:
            s.root, s.initialised, s.comm = root, True, root.comm
            if s is not state and s.post_optim_event is not None:  # set before this forward
                state.post_optim_event, s.post_optim_event = s.post_optim_event, None
            if s.reshard_after_forward is None:
                # The root's parameters would be freed and gathered again at once.
                s.reshard_after_forward = s is not state
        return root

    def begin_forward(self, state: S) -> None:
        """`state`'s forward encloses every other of this iteration: start the iteration."""
        self.forward_root = state
        for s in self.states:  # what changed since the last iteration
            s.unit.adopt_registered()
        event, self.state.post_optim_event = self.state.post_optim_event, None
        unit = state.unit
        if (side := unit.streams) is not None:
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
            # A list unit whose modules did not all run (e.g. a head skipped by a chunked
            # loss) still ends its forward with the forward that enclosed it.
            s.end_partial_forward(output)
            if s.lends and no_backward:  # lenders keep their parameters: free them now
                s.unit.reshard()

    def queue_final_callback(self) -> None:
        self.final_callback_queued = True
        Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """End of backward: finish every unit no hook finished, in module order (the same
        on every rank), wait for the reductions, commit the gradients, go back to IDLE."""
        for s in self.states:
            s.finish_backward()
        self.comm.finish_reductions()
        for s in self.states:  # see Note [gradients per backward] in unit/grad_ledger.py
            s.unit.commit_backward()
        self.final_callback_queued = False

    def finalize_backward(self) -> None:
        """FSDPModule.finalize_backward: between iterations, reduce what backwards without
        gradient sync left unsharded, as the end of a backward would now."""
        if bad := [s.label for s in self.states if s.awaits_backward]:
            raise RuntimeError(
                f"finalize_backward: units {bad} are between a forward and its backward; "
                "call it after the step's backward passes."
            )
        self.finish_backward()

    def reset(self) -> None:
        """Forget the current iteration: every unit IDLE and resharded, the gradients of an
        unfinished backward dropped (those of finished ones kept), nothing pending."""
        for s in self.states:
            s.forget_iteration()
        self.forward_root = None
        self.final_callback_queued = False
        self.forward_prefetched.clear()


def _units_under(root: S) -> list[S]:
    """The units under `root`'s module in module order, labelled by their fqn."""
    states: list[S] = []
    for fqn, module in root.modules[0].named_modules():
        s = cast("S | None", state_of(module))
        if s is None or any(s is seen for seen in states):
            continue
        if s is not root and s.initialised:
            raise RuntimeError(
                f"fully_shard: the unit at {fqn!r} ({type(module).__name__}) already ran "
                f"forward as a root before its enclosing unit "
                f"{type(root.modules[0]).__name__}. Run forward through the outermost "
                "annotated module first."
            )
        s.unit.label = fqn or f"<root {type(module).__name__}>"
        s.unit.fqn_prefix = f"{fqn}." if fqn else ""
        states.append(s)
    return states


def _local_problem(states: list[S]) -> str | None:
    """What this rank alone can see is wrong (every rank raises it: check_ranks_agree)."""
    return next((p for s in states if (p := s.unit.meta_problem()) is not None), None)
