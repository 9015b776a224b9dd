"""What benchmarks/step.py measures on GPUs only: model FLOPs utilisation, and the share of
communication hidden under compute (from a profiler trace)."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from overlap import hidden_fraction
from torch.profiler import ProfilerActivity, profile


def mfu(args: argparse.Namespace, params: int, median: dict[str, float]) -> dict[str, float]:
    """Per contender, the FLOPs of a step over its median time, as a fraction of
    --peak-tflops (per GPU, in the dtype computed in): 6 per parameter and token (forward
    and backward) plus attention's 12 per layer, dim, position and token."""
    tokens = args.batch * args.seq
    flops = 6 * params * tokens + 12 * args.depth * args.dim * args.seq * tokens
    return {n: flops / t / (args.peak_tflops * 1e12) for n, t in median.items()}


def hidden_communication(step: Callable[[], object]) -> float:
    """The fraction of GPU time off the compute stream (collectives and their copies, on
    their own streams) that ran while the compute stream was busy, over three profiled
    calls of `step`."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            spans.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    return hidden_fraction(spans)
