"""benchmarks/gpu_check.py, the one command of every GPU check, runs its whole sequence on
the CPU (--cpu: tiny sizes) and its summary says what it saw: every test of the GPU files
that can run without a GPU passed, each benchmark ran, and the deterministic loss
comparison is exact (0.0 against FSDP2, and FSDP2 against itself) with a falling loss;
AdamW's step alone ran for every policy and variant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_its_sequence_on_the_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    outcomes = summary["tests"]["outcomes"]
    on_ranks = {n: o for n, o in outcomes.items() if n.startswith("test_cuda_ranks::")}
    assert len(on_ranks) == 16 and set(on_ranks.values()) == {"passed"}, on_ranks
    one_gpu = {n: o for n, o in outcomes.items() if n.startswith("test_cuda::")}
    assert one_gpu and all(o.startswith("skipped: needs a GPU") for o in one_gpu.values())
    assert set(summary["benchmarks"]) == {"llama eager", "llama compiled", "gpt bf16"}
    for name, bench in summary["benchmarks"].items():
        parity = bench["loss_parity"]
        assert parity["ours_vs_fsdp2"] == 0.0 and parity["fsdp2_vs_fsdp2"] == 0.0, (name, parity)
        assert parity["loss_falls"], (name, bench["losses"])
        assert set(bench["contenders"]) == {"fsdp_compose", "FSDP2", "DDP", "floor"}
        assert bench["contenders"]["fsdp_compose"]["step_ms"] > 0
    optimizer = summary["optimizer"]["rows"]
    assert len(optimizer) == 9
    assert all(row["plain"] > 0 and row["ours_vs_plain"] > 0 for row in optimizer.values())
    page = (tmp_path / "summary.md").read_text()
    assert page.startswith("# GPU check (cpu): PASS") and "FSDP2 again 0" in page
    assert "| 64, bf16, fused |" in page
