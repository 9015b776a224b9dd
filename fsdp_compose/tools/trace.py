"""StepTrace: what each unit did in one or more training steps, on this rank: its collectives
(bytes, time blocked), its compute, the memory held at each, as the runtime's observer."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from ..comm import process_wide
from ..comm.collectives import every_rank
from ..schedule.iteration import UnitState, state_of
from ..schedule.phase import in_backward
from . import trace_report
from .trace_report import ALL_GATHER, BACKWARD, COMPUTE, FORWARD, REDUCE_SCATTER, Span

# The kind of span each runtime event opens (an issue) or closes (a wait).
_OPENS = {process_wide.ISSUE_GATHER: ALL_GATHER, process_wide.ISSUE_REDUCE: REDUCE_SCATTER}
_CLOSES = {process_wide.WAIT_GATHER: ALL_GATHER, process_wide.WAIT_REDUCE: REDUCE_SCATTER}


class StepTrace:
    """Record every unit of `model` (annotated) while open:

        with StepTrace(model) as trace:
            loss = model(batch).sum(); loss.backward(); optimizer.step()
        print(trace.table())
        trace.save_chrome("step.json")  # every rank calls it: rank 0 writes all ranks
        trace.save_png("step.png")      # this rank's units over time, and memory

    Memory at a span's end: on an accelerator its allocator's; on the CPU what fsdp_compose holds
    beyond the shards (unsharded parameters, communication buffers). Each span is also a
    torch.profiler range "fsdp::<unit> <what>"."""

    def __init__(self, model: nn.Module) -> None:
        self.spans: list[Span] = []
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._states = {id(s): s for m in model.modules() if (s := state_of(m)) is not None}
        if not self._states:
            raise ValueError(f"StepTrace: {type(model).__name__} has no fully_shard units.")
        self._part_of = {id(part): s for s in self._states.values() for part in s.unit.parts}
        self._hooks: list[RemovableHandle] = []
        self._origin = 0.0
        self._open: dict[tuple[int, str, str], Span] = {}  # spans begun, not yet ended
        # Events begun, not yet ended: their start and profiler range, by (part, event).
        self._events: dict[tuple[int, str], tuple[float, Any]] = {}
        # Every unit computes on the same device.
        self._device = next(iter(self._states.values())).unit.device

    # -- opening and closing -----------------------------------------------------------------

    def __enter__(self) -> StepTrace:
        if process_wide.observer is not None:
            raise RuntimeError("StepTrace: another trace is open; one at a time (close it first).")
        self._origin = time.perf_counter()
        for state in self._states.values():
            self._hook_forward(state)
        process_wide.observe(self)
        return self

    def __exit__(self, *exc: object) -> None:
        process_wide.observe(None)
        while self._hooks:
            self._hooks.pop().remove()
        for _, record in self._events.values():  # ranges an exception left open
            record.__exit__(None, None, None)
        self._events.clear()

    def _now(self) -> float:
        return time.perf_counter() - self._origin

    def _hook_forward(self, state: UnitState) -> None:
        def forward_began(module: nn.Module, args: Any) -> None:
            if not in_backward():  # (a recomputation in backward belongs to backward)
                self._begin(state, COMPUTE, FORWARD, self._now())

        # The pre-hook runs after fully_shard's, the (prepended) post-hook before it.
        for module in state.modules:
            self._hooks.append(module.register_forward_pre_hook(forward_began))
            self._hooks.append(module.register_forward_hook(
                lambda *_: self._end(state, COMPUTE, FORWARD), prepend=True))

    # -- the runtime's events (see comm/process_wide.py) -------------------------------------

    def begin(self, part: object, event: str) -> None:
        if (state := self._part_of.get(id(part))) is None:
            return  # another model's unit
        name = f"fsdp::{state.unit.fqn_prefix.rstrip('.')} {event}"
        if event == process_wide.ISSUE_GATHER:
            name += f" {BACKWARD if in_backward() else FORWARD}"
        self._events[id(part), event] = self._now(), record_function(name).__enter__()

    def end(self, part: object, event: str, nbytes: int = 0) -> None:
        if (state := self._part_of.get(id(part))) is None:
            return
        begun, record = self._events.pop((id(part), event))
        record.__exit__(None, None, None)
        blocked = self._now() - begun
        if event in _CLOSES:
            self._end(part, _CLOSES[event], None, blocked)
        elif event == process_wide.ISSUE_GATHER or nbytes:  # (a reduction of nothing: no span)
            forward = event == process_wide.ISSUE_GATHER and not in_backward()
            phase = FORWARD if forward else BACKWARD
            self._begin(state, _OPENS[event], phase, begun, part, nbytes=nbytes, blocked=blocked)

    def backward_began(self, state: object) -> None:
        if id(state) in self._states and (id(state), COMPUTE, BACKWARD) not in self._open:
            self._begin(state, COMPUTE, BACKWARD, self._now())  # type: ignore[arg-type]

    def backward_done(self, state: object) -> None:
        self._end(state, COMPUTE, BACKWARD)  # the unit's gradients are all there (synced or not)

    # -- what is recorded ----------------------------------------------------------------------

    def _begin(self, state: UnitState, kind: str, phase: str, start: float, by: object = None,
               **fields: Any) -> None:
        """Open a span of `state`'s unit; `by` (default: the unit) tells its parts' spans apart."""
        key = id(state if by is None else by), kind, phase
        self._open[key] = Span(state.unit.fqn_prefix.rstrip("."), kind, phase, start, start,
                               **fields)

    def _end(self, by: object, kind: str, phase: str | None = None, blocked: float = 0.0) -> None:
        """End the span of `kind` that `by` (a unit's state or a part) opened, in `phase` or any."""
        for p in (phase,) if phase else (FORWARD, BACKWARD):
            if (span := self._open.pop((id(by), kind, p), None)) is not None:
                span.end = self._now()
                span.blocked += blocked
                span.memory = self.memory()
                self.spans.append(span)
                return

    def memory(self) -> int:
        """Bytes held now (see the class docstring)."""
        if self._device.type != "cpu":
            return int(torch.get_device_module(self._device.type).memory_allocated(self._device))
        return sum(s.unit.held_bytes() for s in self._states.values())

    # -- results -------------------------------------------------------------------------------

    def table(self) -> str:
        """Per unit and pass: collectives' bytes and ms, compute, exposed time, peak memory."""
        return trace_report.unit_table(self.spans, on_cpu=self._device.type == "cpu")

    def save_chrome(self, path: str) -> None:
        """A Chrome trace (Perfetto, chrome://tracing) of all ranks: all call it, rank 0 writes."""
        spans = every_rank(self.spans)
        if self.rank == 0:
            trace_report.chrome_trace(path, spans)

    def save_png(self, path: str) -> None:
        """This rank's units over time above the memory held; needs matplotlib ([bench])."""
        trace_report.draw_timeline(path, self.spans, self.rank)
