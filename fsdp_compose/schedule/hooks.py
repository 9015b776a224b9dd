"""A unit's forward hooks: the module pre-hook unshards it and the post-hook reshards it,
moving its UnitState through its phases (iteration.py). The first forward of the outermost
annotated module makes it the root of every unit below it (lazy init)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..param.policies import cast_floating
from ..unit.settings import UnitSettings
from .agreement import check_ranks_agree
from .backward_done import Inputs
from .iteration import Root, UnitState, state_of
from .phase import FORWARD, IDLE, current_graph_task_id, in_backward
from .unmanaged import stop_watching

# Under torch.compile the hooks run eagerly, outside the graph: they communicate and resize
# storage, which graphs cannot hold. They call this first thing when dynamo traces them
# (is_dynamo_compiling() reads True), so compilation breaks the graph around them.
run_eagerly: Callable[..., Any] = torch.compiler.disable(lambda hook, *args: hook(*args))


def install_hooks(state: UnitState) -> None:
    for module in state.modules:
        pre = functools.partial(pre_forward, state)
        module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        # Also called when forward raised, to undo what pre_forward did.
        module.register_forward_hook(functools.partial(post_forward, state), always_call=True)


def pre_forward(state: UnitState, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Inputs:
    if torch.compiler.is_dynamo_compiling():
        return run_eagerly(pre_forward, state, module, args, kwargs)  # type: ignore[no-any-return]
    if not state.initialised:
        make_root(state)  # the first forward: this unit is the root of all below it
        stop_watching()  # for parameters no unit manages: see schedule/unmanaged.py
    if state.input_dtype is not None:
        args, kwargs = cast_floating((args, kwargs), state.input_dtype)
    if current_graph_task_id() != -1:
        # Activation checkpointing re-runs forward inside backward. After a forward with grad
        # (non-reentrant checkpointing) the unit's hooks own its backward: only make sure the
        # parameters are there. After one without (reentrant: the recomputation's own backward
        # follows at once) its backward begins here.
        if not state.backward_end.hooked_in_forward and torch.is_grad_enabled():
            state.pre_backward(None)
            args, kwargs = state.backward_end.hook_forward(args, kwargs, recomputed=True)
        state.unshard()
        return args, kwargs
    root = state.root
    if root.final_callback_queued:
        # The last backward raised before it finished: forget it, keep what earlier
        # backwards accumulated, and start this iteration from a clean state.
        root.reset()
    if state.phase is IDLE:
        state.modules_to_run = set(state.modules)
        if root.forward_root is None:
            root.begin_forward(state)
        state.prefetch.forward_index = len(root.forward_order)
        root.forward_order.append(state)
    if FORWARD not in state.phase.next:
        state.refuse(FORWARD)
    state.phase = FORWARD
    state.unshard()
    if (settings := state.settings).forward_prefetch or settings.implicit_forward_prefetch:
        for other in state.prefetch.in_forward(state, root.last_forward_order):
            state.comm.prefetch(other.unit)  # overlaps this unit's compute; waited for there
            root.forward_prefetched.append(other)
    if torch.is_grad_enabled():
        args, kwargs = state.backward_end.hook_forward(args, kwargs)
    return args, kwargs


def post_forward(state: UnitState, module: nn.Module, args: Any, output: Any) -> Any:
    if torch.compiler.is_dynamo_compiling():
        return run_eagerly(post_forward, state, module, args, output)
    # nn.Module calls this hook with output None when forward raised, from inside its
    # `except` (a forward returning None while its caller handles an exception reads as
    # failed too: nothing can run backward through it, and the unit is resharded).
    if output is None and sys.exc_info()[1] is not None:
        _after_failed_forward(state, module)
        return None
    if current_graph_task_id() != -1:  # a recomputation in backward: see pre_forward
        return output if state.output_dtype is None else cast_floating(output, state.output_dtype)
    state.modules_to_run.discard(module)
    state.register_pre_backward(output)
    if state.output_dtype is not None:
        output = cast_floating(output, state.output_dtype)
    root = state.root
    if state.modules_to_run and root.forward_root is not state:
        # A list unit waiting for its other modules inside the enclosing forward. (A module
        # of it called on its own, e.g. a head by a chunked loss, is the enclosing forward:
        # its forward ends here.)
        return output
    state.finish_forward()
    if root.forward_root is state:
        root.end_forward(output)
    return output


def _after_failed_forward(state: UnitState, module: nn.Module) -> None:
    """`module`'s forward raised: undo its pre-hook (the iteration's if it enclosed the others)."""
    if state.phase is not FORWARD or module not in state.modules_to_run or in_backward():
        return  # not a forward of ours in progress (e.g. a recomputation in backward)
    if state.root.forward_root is state:
        state.root.reset()
    else:
        state.modules_to_run.discard(module)
        if not state.modules_to_run:
            state.unit.reshard()
            state.phase = IDLE


# -- lazy init ---------------------------------------------------------------------------


def make_root(state: UnitState) -> None:
    """Make `state`'s unit the root of every unit below it (its first forward): label them, check
    the model on this rank, then across ranks, and point them to the root and its comm context."""
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
    problem = next((p for s in states if (p := s.unit.meta_problem()) is not None), None)
    check_ranks_agree([s.unit for s in states], state.unit.mesh, problem)
    if problem is not None:  # a one-rank mesh has no gather to raise it
        raise RuntimeError(problem)
    default = UnitSettings(None)
    bounds = ("max_all_gathers_in_flight", "reduce_scatter_max_input_buffers")
    if changed := [s.label for s in states[1:] if any(
            getattr(s.settings, b) != getattr(default, b) for b in bounds)]:
        raise ValueError(
            f"fsdp_compose: the communication bounds were set on {changed}, which are not "
            f"roots: their root {state.label} runs them. Call the setter on the root."
        )
    root = Root(state, states)
    for s in states:
        s.root, s.initialised, s.comm = root, True, state.comm
        if s is not state and (event := s.settings.post_optim_event) is not None:  # set before
            state.settings.post_optim_event, s.settings.post_optim_event = event, None


def _units_under(root: UnitState) -> list[UnitState]:
    """The units under `root`'s module in module order, labelled by their fqn."""
    states: list[UnitState] = []
    for fqn, module in root.modules[0].named_modules():
        if (s := state_of(module)) is None or s in states:  # a unit of several modules: seen
            continue
        if s is not root and s.initialised:
            raise RuntimeError(
                f"fully_shard: the unit at {fqn!r} ({type(module).__name__}) already ran forward "
                f"as a root before its enclosing unit {type(root.modules[0]).__name__}. Run "
                "forward through the outermost annotated module first."
            )
        s.unit.name(fqn, fqn or f"<root {type(module).__name__}>")
        states.append(s)
    return states
