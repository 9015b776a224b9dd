"""StepTrace: what each unit did in one or more training steps, on this rank: its
all-gathers and reduce-scatters (issued, waited for, bytes, time the rank was blocked), its
forward and backward compute, and the memory held at each.

While a trace is open it wraps the methods that issue and wait for each unit's
collectives and hooks its modules' forward; on exit it removes every wrapper and hook, so
the runtime then runs exactly the code it runs untraced (nothing to pay when off). Each
span is also a `torch.profiler.record_function` range, "fsdp::<unit> <what> <pass>", so it
shows in torch.profiler traces. Rendering (table, Chrome trace, picture) is in
_trace_report.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._hooks import UnitState, state_of
from ._phase import in_backward
from ._trace_report import (
    ALL_GATHER, BACKWARD, COMPUTE, FORWARD, REDUCE_SCATTER, Span, chrome_trace, draw_timeline,
    unit_table,
)
from ._unit import Unit

# The trace open now, if any: one at a time, as each wraps methods of the runtime's classes.
_open: list[StepTrace] = []


class StepTrace:
    """Record every unit of `model` (annotated) while open:

        with StepTrace(model) as trace:
            loss = model(batch).sum(); loss.backward(); optimizer.step()
        print(trace.table())
        trace.save_chrome("step.json")  # every rank calls it: rank 0 writes all ranks
        trace.save_png("step.png")      # this rank's units over time, and memory

    Memory at each span's end: on an accelerator the bytes its allocator holds for
    tensors; on the CPU the bytes fsdp_compose holds beyond the shards (unsharded
    parameters and communication buffers), which is what sharding changes.
    """

    def __init__(self, model: nn.Module) -> None:
        self.spans: list[Span] = []
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        states = {id(s): s for m in model.modules() if (s := state_of(m)) is not None}
        if not states:
            raise ValueError(f"StepTrace: {type(model).__name__} has no fully_shard units.")
        self._states: list[UnitState] = list(states.values())
        self._undo: list[Callable[[], None]] = []
        self._origin = 0.0
        self._open: dict[tuple[int, str, str], Span] = {}  # spans begun, not yet ended
        # Methods wrapped in their class while open: the class's own function, and the
        # wrapper of each traced instance (by id).
        self._originals: dict[tuple[type, str], Callable[..., Any]] = {}
        self._routes: dict[tuple[type, str], dict[int, Callable[..., Any]]] = {}
        self._device = self._states[0].unit.device  # every unit of a model computes there

    # -- opening and closing -----------------------------------------------------------------

    def __enter__(self) -> StepTrace:
        if _open:
            raise RuntimeError("StepTrace: another trace is open; one at a time (close it first).")
        _open.append(self)
        self._origin = time.perf_counter()
        try:
            for state in self._states:
                for part in state.unit.parts:
                    self._wrap_unit(state, part)
                self._wrap_state(state)
        except BaseException:
            self.__exit__()  # what was wrapped so far, unwrapped
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._originals.clear()
        self._routes.clear()
        _open.remove(self)

    def _now(self) -> float:
        return time.perf_counter() - self._origin

    def _patch(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Make `owner.name` call `make(original)` until exit. An instance attribute (a bound
        method kept there) gets the wrapper as its value; a method of the class is wrapped
        in the class, for `owner` only. (Adding and deleting instance attributes, or even
        reading `vars(owner)`, would leave the instance's attributes slower to read after
        the trace: CPython then keeps them in a dict of their own.)"""
        cls = type(owner)
        current = getattr(owner, name)
        if not (isinstance(current, MethodType) and current.__self__ is owner
                and current.__func__ is cls.__dict__.get(name)):
            setattr(owner, name, make(current))
            self._undo.append(lambda: setattr(owner, name, current))
            return
        if (cls, name) not in self._originals:  # the first of its class: route the class's
            function = self._originals[cls, name] = cls.__dict__[name]
            routes = self._routes[cls, name] = {}

            def routed(this: Any, *args: Any, **kwargs: Any) -> Any:
                traced = routes.get(id(this))
                return traced(*args, **kwargs) if traced is not None else function(this, *args, **kwargs)

            setattr(cls, name, routed)
            self._undo.append(lambda: setattr(cls, name, function))
        original = MethodType(self._originals[cls, name], owner)
        self._routes[cls, name][id(owner)] = make(original)

    def _hook(self, handle: RemovableHandle) -> None:
        self._undo.append(handle.remove)

    # -- what is recorded ----------------------------------------------------------------------

    def _name(self, state: UnitState) -> str:
        return state.unit.fqn_prefix.rstrip(".")

    def _begin(
        self, state: UnitState, kind: str, phase: str, start: float, by: object = None,
        **fields: Any,
    ) -> None:
        """A span of `state`'s unit begins; `by` (default the unit) tells apart the spans of
        one unit that overlap (its parts' collectives, with parameters on several meshes)."""
        key = id(state if by is None else by), kind, phase
        self._open[key] = Span(self._name(state), kind, phase, start, start, **fields)

    def _end(
        self, state: UnitState, kind: str, phase: str | None = None, blocked: float = 0.0,
        by: object = None,
    ) -> None:
        for p in (phase,) if phase else (FORWARD, BACKWARD):
            span = self._open.pop((id(state if by is None else by), kind, p), None)
            if span is not None:
                span.end = self._now()
                span.blocked += blocked
                span.memory = self.memory()
                self.spans.append(span)
                return

    def memory(self) -> int:
        """Bytes held now: see the class docstring."""
        device = self._device
        if device.type != "cpu":
            return int(torch.get_device_module(device.type).memory_allocated(device))
        return sum(part.held_bytes() for s in self._states for part in s.unit.parts)

    def _wrap_unit(self, state: UnitState, part: Unit) -> None:
        gatherer, reducer = part.gatherer, part.reducer

        def start(original: Callable[..., Any]) -> Callable[..., Any]:
            def traced(*args: Any, **kwargs: Any) -> Any:
                phase, begun = (BACKWARD if in_backward() else FORWARD), self._now()
                with torch.profiler.record_function(f"fsdp::{self._name(state)} all-gather {phase}"):
                    gather = original(*args, **kwargs)
                nbytes = gather.gathered.numel() * gather.gathered.element_size()
                self._begin(state, ALL_GATHER, phase, begun, by=part, nbytes=nbytes,
                            blocked=self._now() - begun)
                return gather
            return traced

        def waits_for(kind: str, phase: str | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            """A wrapper of the wait for `kind`, which ends its span."""
            def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
                def traced(*args: Any, **kwargs: Any) -> Any:
                    begun = self._now()
                    with torch.profiler.record_function(f"fsdp::{self._name(state)} {kind} wait"):
                        result = original(*args, **kwargs)
                    self._end(state, kind, phase, blocked=self._now() - begun, by=part)
                    return result
                return traced
            return wrap

        def reduce(original: Callable[..., Any]) -> Callable[..., Any]:
            def traced(*args: Any, **kwargs: Any) -> Any:
                self._end(state, COMPUTE, BACKWARD)  # the unit's gradients are all there
                begun = self._now()
                with torch.profiler.record_function(f"fsdp::{self._name(state)} reduce-scatter"):
                    started = original(*args, **kwargs)
                if started:
                    rows = reducer._pending.input if reducer._pending is not None else None
                    nbytes = 0 if rows is None else rows.numel() * rows.element_size()
                    self._begin(state, REDUCE_SCATTER, BACKWARD, begun, by=part, nbytes=nbytes,
                                blocked=self._now() - begun)
                return started
            return traced

        self._patch(gatherer, "_start", start)
        waited, finished = waits_for(ALL_GATHER, None), waits_for(REDUCE_SCATTER, BACKWARD)
        self._patch(gatherer, "wait_for_unshard", waited)
        self._patch(part, "wait_for_unshard", waited)
        self._patch(part, "reduce_grads", reduce)
        self._patch(reducer, "finish_reduction", finished)
        self._patch(part, "finish_reduction", finished)

    def _wrap_state(self, state: UnitState) -> None:
        def forward_began(module: nn.Module, args: Any) -> None:
            if not in_backward():  # (a recomputation in backward belongs to backward)
                self._begin(state, COMPUTE, FORWARD, self._now())

        def forward_ended(module: nn.Module, args: Any, output: Any) -> None:
            self._end(state, COMPUTE, FORWARD)

        def pre_backward(original: Callable[..., Any]) -> Callable[..., Any]:
            def traced(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)  # gathers the parameters if needed
                if (id(state), COMPUTE, BACKWARD) not in self._open:
                    self._begin(state, COMPUTE, BACKWARD, self._now())
                return result
            return traced

        for module in state.modules:
            self._hook(module.register_forward_pre_hook(forward_began))  # after fully_shard's
            self._hook(module.register_forward_hook(forward_ended, prepend=True))  # before its
        self._patch(state, "_pre_backward", pre_backward)

    # -- results -------------------------------------------------------------------------------

    def table(self) -> str:
        """Per unit and pass: bytes and milliseconds of its collectives, its compute, the
        communication it waited for (not hidden by compute), the peak memory."""
        return unit_table(self.spans, on_cpu=self._device.type == "cpu")

    def save_chrome(self, path: str) -> None:
        """A Chrome trace (Perfetto, chrome://tracing) of every rank: a process per rank, a
        lane per stream (compute, all-gather, reduce-scatter), a memory counter. Collective:
        every rank calls it; the first writes."""
        spans: list[list[Span]] = [self.spans]
        if dist.is_initialized():
            spans = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(spans, self.spans)
        if self.rank == 0:
            chrome_trace(path, spans)

    def save_png(self, path: str) -> None:
        """This rank's units over time (compute and collectives per unit) above the memory
        held; needs matplotlib (`pip install "fsdp_compose[bench]"`)."""
        draw_timeline(path, self.spans, self.rank)
