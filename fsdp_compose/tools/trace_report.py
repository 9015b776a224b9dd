"""What a StepTrace records (Span), and its spans as a table, a Chrome trace and a picture."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

FORWARD, BACKWARD = "forward", "backward"
ALL_GATHER, REDUCE_SCATTER, COMPUTE = "all-gather", "reduce-scatter", "compute"
_LANES = (COMPUTE, ALL_GATHER, REDUCE_SCATTER)


@dataclasses.dataclass
class Span:
    """One thing a unit did, in seconds since the trace opened."""

    unit: str  # the unit's modules' fqn under the root ("" for the root)
    kind: str  # ALL_GATHER, REDUCE_SCATTER or COMPUTE
    phase: str  # FORWARD or BACKWARD
    start: float
    end: float
    blocked: float = 0.0  # communication: seconds the rank spent in its calls (not hidden)
    nbytes: int = 0  # communication: the collective's whole buffer
    memory: int = 0  # bytes held when it ended (see StepTrace.memory)


_MIB = 2**20


def _label(unit: str) -> str:
    return unit or "(root)"


def unit_table(spans: Sequence[Span], on_cpu: bool) -> str:
    """A row per unit and pass, in order of first run; a unit's compute excludes inner units'."""
    rows: dict[tuple[str, str], defaultdict[str, float]] = {}
    for s in sorted(spans, key=lambda s: s.start):
        row = rows.setdefault((s.phase, s.unit), defaultdict(float))
        row["peak"] = max(row["peak"], s.memory / _MIB)
        row[s.kind + " ms"] += (_own(s, spans) if s.kind == COMPUTE else s.end - s.start) * 1e3
        row[s.kind + " MiB"] += s.nbytes / _MIB
        row["exposed ms"] += s.blocked * 1e3
    columns = {  # header: (row key, width)
        "compute ms": ("compute ms", 11), "AG MiB": ("all-gather MiB", 9),
        "AG ms": ("all-gather ms", 8), "RS MiB": ("reduce-scatter MiB", 9),
        "RS ms": ("reduce-scatter ms", 8), "exposed ms": ("exposed ms", 11),
        "held MiB" if on_cpu else "allocated MiB": ("peak", 15),
    }
    lines = [f"{'pass':<9}{'unit':<24}" + "".join(f"{h:>{w}}" for h, (_, w) in columns.items())]
    for (phase, unit), row in rows.items():
        lines.append(f"{phase:<9}{_label(unit)[:23]:<24}"
                     + "".join(f"{row[key]:>{w}.3f}" for key, w in columns.values()))
    exposed = sum(s.blocked for s in spans) * 1e3
    lines += [f"communication not hidden by compute: {exposed:.3f} ms (time blocked in "
              "collectives)", "compute: each unit's own, without the units running inside it"]
    return "\n".join(lines)


def _own(span: Span, spans: Sequence[Span]) -> float:
    """`span`'s duration less the time other units computed inside it (their union)."""
    inside = sorted((max(o.start, span.start), min(o.end, span.end)) for o in spans
                    if o.kind == COMPUTE and o.unit != span.unit
                    and o.start < span.end and o.end > span.start)
    covered, reached = 0.0, span.start
    for start, end in inside:
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return span.end - span.start - covered


def chrome_trace(path: str, ranks: Sequence[Sequence[Span]]) -> None:
    """Trace Event Format: a process per rank, a thread per lane, a "memory" counter per rank."""
    events: list[dict[str, Any]] = []
    for rank, spans in enumerate(ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                    "args": {"name": lane}} for tid, lane in enumerate(_LANES)]
        for s in spans:
            # Complete events, in microseconds.
            events += [{"ph": "X", "name": f"{_label(s.unit)} {s.kind}", "cat": s.phase,
                        "pid": rank, "tid": _LANES.index(s.kind), "ts": s.start * 1e6,
                        "dur": (s.end - s.start) * 1e6, "args": {
                            "bytes": s.nbytes, "blocked_us": s.blocked * 1e6, "pass": s.phase}},
                       {"ph": "C", "name": "memory", "pid": rank, "ts": s.end * 1e6,
                        "args": {"MiB": s.memory / _MIB}}]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def draw_timeline(path: str, spans: Sequence[Span], rank: int) -> None:
    """A row per unit (compute, and collectives as thin bars), below it the memory held."""
    import matplotlib  # an optional dependency: fsdp_compose[bench]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = list(dict.fromkeys(s.unit for s in sorted(spans, key=lambda s: s.start)))
    # Compute by pass, collectives by kind.
    colors = {FORWARD: "tab:blue", BACKWARD: "tab:orange", ALL_GATHER: "tab:green",
              REDUCE_SCATTER: "tab:red"}
    # Rows count down (the axis is inverted): all-gathers drawn above compute, reductions below.
    offsets = {COMPUTE: (-0.3, 0.6), ALL_GATHER: (-0.5, 0.18), REDUCE_SCATTER: (0.32, 0.18)}
    figure, (lanes, memory) = plt.subplots(
        2, 1, figsize=(10, 1.2 + 0.45 * len(units)), sharex=True,
        gridspec_kw={"height_ratios": [max(len(units), 2), 2]})
    for s in spans:
        y, height = offsets[s.kind]
        color = colors[s.phase if s.kind == COMPUTE else s.kind]
        lanes.broken_barh([(s.start * 1e3, max((s.end - s.start) * 1e3, 1e-3))],
                          (units.index(s.unit) + y, height), color=color)
    lanes.set_yticks(range(len(units)), [_label(u) for u in units])
    lanes.invert_yaxis()
    lanes.set_title(f"rank {rank}: compute (blue forward, orange backward), all-gather (green, "
                    "above), reduce-scatter (red, below)", fontsize=9)
    ordered = sorted(spans, key=lambda s: s.end)
    memory.step([s.end * 1e3 for s in ordered], [s.memory / _MIB for s in ordered], where="post")
    memory.set(ylabel="MiB held", xlabel="ms since the trace opened")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
