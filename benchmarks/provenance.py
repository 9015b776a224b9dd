"""Where, when and how a benchmark ran, recorded in its JSON next to the results (for
benchmarks/report.py, which writes docs/performance.md from them)."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone

import torch


def provenance(device: torch.device | None = None) -> dict:
    """The date (UTC), torch and Python versions, the machine, and the script's arguments."""
    try:
        cpus = len(os.sched_getaffinity(0))  # what this process may run on
    except AttributeError:  # not on Linux
        cpus = os.cpu_count()
    gpu = None
    if device is not None and device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": {"platform": platform.platform(), "cpu": _cpu_name(), "cpus": cpus, "gpu": gpu},
        "argv": sys.argv[1:],
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
