"""How much of the time spent off the compute stream (collectives and their copies, on
their own streams) ran while the compute stream was busy too: benchmarks/step.py's hidden
communication, from a profiler trace's spans."""

from __future__ import annotations


def hidden_fraction(spans: dict[int, list[tuple[float, float]]]) -> float:
    """Of the time some stream other than the compute stream (the one busy longest) is busy,
    the fraction the compute stream is busy too. `spans`: (start, end) per stream."""
    if len(spans) < 2:
        return 1.0  # nothing ran beside the compute stream
    compute = max(spans, key=lambda s: sum(end - start for start, end in spans[s]))
    busy = _union(spans[compute])
    side = _union([span for s, stream in spans.items() if s != compute for span in stream])
    total = sum(end - start for start, end in side)
    hidden = sum(
        max(0.0, min(end, b_end) - max(start, b_start))
        for start, end in side for b_start, b_end in busy
    )
    return hidden / total if total else 1.0


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
