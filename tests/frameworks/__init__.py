"""Real frameworks on fsdp_compose through `python -m fsdp_compose.run`, their scripts as
they are, against torch's fully_shard (see the test modules)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def torchrun(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node=2 ARGS` from the repository root. A worker
    that a signal killed (a native crash: torchrun reports a negative exit code) gets the
    job run once more, as tests/conftest.py does for its rank pools; any other failure, or
    a second crash, fails the test with both outputs' tails."""
    for attempt in (1, 2):
        result = subprocess.run(
            [*TORCHRUN, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
        crashed = re.search(r"exitcode\s*:\s*-\d+", result.stderr) is not None
        if result.returncode == 0 or not crashed or attempt == 2:
            break
        print(f"torchrun: a worker crashed; once more:\n{result.stderr[-6000:]}", file=sys.stderr)
    assert result.returncode == 0, (
        f"torchrun {' '.join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    )
    return result


def run_script(
    launcher: list[str], script: list[str], precision: str, steps: int, out_dir: Path
) -> dict:
    """Train with a framework script under torchrun (`launcher` in front of it: a shim, the
    launcher, or both), saving at step 2, and read back what it recorded (record.py)."""
    out = out_dir.with_suffix(".json")
    torchrun([
        *launcher, *script, "--precision", precision, "--steps", str(steps), "--save-steps", "2",
        "--out", str(out), "--output-dir", str(out_dir),
    ])
    result: dict = json.loads(out.read_text())
    return result


def assert_whose(torch_run: dict, ours: dict) -> None:
    """torch's fully_shard ran in `torch_run`, fsdp_compose's in `ours` (the launcher's), on
    the same modules: the name the script holds and the classes of what it annotated."""
    assert torch_run["fully_shard"].startswith("torch.distributed."), torch_run["fully_shard"]
    assert ours["fully_shard"].startswith("fsdp_compose."), ours["fully_shard"]
    assert ours["fsdp_classes"].keys() == torch_run["fsdp_classes"].keys()
    for run, prefix in ((torch_run, "torch.distributed.fsdp."), (ours, "fsdp_compose.")):
        for classes in run["fsdp_classes"].values():
            assert all(c.startswith(prefix) for c in classes), classes
