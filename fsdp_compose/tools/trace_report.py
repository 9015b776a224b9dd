"""What a StepTrace records (Span), and its spans as a table, a Chrome trace and a picture."""

from __future__ import annotations

import dataclasses
import json
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
    """One row per unit and pass, in the order the units first ran in that pass."""
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for s in sorted(spans, key=lambda s: s.start):
        row = rows.setdefault((s.phase, s.unit), {"peak": 0.0})
        row["peak"] = max(row["peak"], s.memory / _MIB)
        row[s.kind + " ms"] = row.get(s.kind + " ms", 0.0) + (s.end - s.start) * 1e3
        row[s.kind + " MiB"] = row.get(s.kind + " MiB", 0.0) + s.nbytes / _MIB
        row["exposed ms"] = row.get("exposed ms", 0.0) + s.blocked * 1e3
    memory = "held MiB" if on_cpu else "allocated MiB"
    header = (f"{'pass':<9}{'unit':<24}{'compute ms':>11}{'AG MiB':>9}{'AG ms':>8}{'RS MiB':>9}"
              f"{'RS ms':>8}{'exposed ms':>11}{memory:>15}")
    lines = [header]
    for (phase, unit), row in rows.items():
        lines.append(
            f"{phase:<9}{_label(unit)[:23]:<24}{row.get('compute ms', 0.0):>11.3f}"
            f"{row.get('all-gather MiB', 0.0):>9.3f}{row.get('all-gather ms', 0.0):>8.3f}"
            f"{row.get('reduce-scatter MiB', 0.0):>9.3f}{row.get('reduce-scatter ms', 0.0):>8.3f}"
            f"{row.get('exposed ms', 0.0):>11.3f}{row['peak']:>15.3f}"
        )
    exposed = sum(s.blocked for s in spans) * 1e3
    lines.append(f"communication not hidden by compute: {exposed:.3f} ms (time blocked in collectives)")
    return "\n".join(lines)


def chrome_trace(path: str, ranks: Sequence[Sequence[Span]]) -> None:
    """Trace Event Format: a process per rank, a thread per lane, complete ("X") events in
    microseconds, and a "memory" counter per rank."""
    events: list[dict[str, Any]] = []
    for rank, spans in enumerate(ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, lane in enumerate(_LANES):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
        for s in spans:
            events.append({
                "ph": "X", "name": f"{_label(s.unit)} {s.kind}", "cat": s.phase, "pid": rank,
                "tid": _LANES.index(s.kind), "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                "args": {"bytes": s.nbytes, "blocked_us": s.blocked * 1e6, "pass": s.phase},
            })
            events.append({"ph": "C", "name": "memory", "pid": rank, "ts": s.end * 1e6,
                           "args": {"MiB": s.memory / _MIB}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def draw_timeline(path: str, spans: Sequence[Span], rank: int) -> None:
    """A row per unit (forward compute, backward compute, collectives as thin bars), and
    below it the memory held over time."""
    import matplotlib  # an optional dependency: fsdp_compose[bench]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = list(dict.fromkeys(s.unit for s in sorted(spans, key=lambda s: s.start)))
    colors = {("compute", "forward"): "tab:blue", ("compute", "backward"): "tab:orange",
              ("all-gather", "forward"): "tab:green", ("all-gather", "backward"): "tab:green",
              ("reduce-scatter", "backward"): "tab:red"}
    # Rows count down (the axis is inverted): all-gathers drawn above compute, reductions below.
    offsets = {"compute": (-0.3, 0.6), "all-gather": (-0.5, 0.18), "reduce-scatter": (0.32, 0.18)}
    figure, (lanes, memory) = plt.subplots(
        2, 1, figsize=(10, 1.2 + 0.45 * len(units)), sharex=True,
        gridspec_kw={"height_ratios": [max(len(units), 2), 2]},
    )
    for s in spans:
        y, height = offsets[s.kind]
        lanes.broken_barh([(s.start * 1e3, max((s.end - s.start) * 1e3, 1e-3))],
                          (units.index(s.unit) + y, height), color=colors.get((s.kind, s.phase), "gray"))
    lanes.set_yticks(range(len(units)), [_label(u) for u in units])
    lanes.invert_yaxis()
    lanes.set_title(f"rank {rank}: compute (blue forward, orange backward), all-gather (green, "
                    "above), reduce-scatter (red, below)", fontsize=9)
    ordered = sorted(spans, key=lambda s: s.end)
    memory.step([s.end * 1e3 for s in ordered], [s.memory / _MIB for s in ordered], where="post")
    memory.set_ylabel("MiB held")
    memory.set_xlabel("ms since the trace opened")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
