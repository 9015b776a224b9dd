"""The benchmarks run, and what they count holds: fsdp_compose sends exactly the analytic
floor of collectives and bytes, peaks no higher in tracked memory than FSDP2, and trains
with FSDP2's and DDP's losses. (Times are the benchmarks' to report, not the tests' to
assert.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_benchmark_reports_the_floor_of_communication(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         str(ROOT / "benchmarks" / "step.py"), "--depth", "2", "--dim", "32", "--seq", "16",
         "--steps", "2", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    result = json.loads((tmp_path / "step.json").read_text())
    floor, ours = result["analytic"], result["communication"]["fsdp_compose"]
    assert ours == result["communication"]["FSDP2"]
    assert ours["calls"] == {"all_gather": floor["all_gather_calls"],
                             "reduce_scatter": floor["reduce_scatter_calls"]}
    assert ours["bytes"] == {"all_gather": floor["all_gather_bytes"],
                             "reduce_scatter": floor["reduce_scatter_bytes"]}
    assert result["max_loss_difference_vs_fsdp2"] == {"fsdp_compose": 0.0, "DDP": 0.0}
    peaks = result["peak_memory"]
    assert set(peaks) == {"fsdp_compose", "FSDP2", "DDP", "floor"}
    assert peaks["fsdp_compose"]["Total"] <= peaks["FSDP2"]["Total"], peaks


def test_overhead_benchmark_reports_both_runtimes():
    output = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--units", "8",
         "--steps", "5", "--repeats", "3"],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
    ).stdout
    rows = {
        name: [float(v) for v in values.split()]
        for name, values in re.findall(r"^(torch fully_shard|fsdp_compose)((?:\s+\S+){5})$",
                                       output, re.MULTILINE)
    }
    assert sorted(rows) == ["fsdp_compose", "torch fully_shard"], output
    for step_ms, per_unit, in_collectives, runtime, calls in rows.values():
        assert step_ms > 0 and in_collectives > 0, output
        assert abs(per_unit - in_collectives - runtime) <= 0.11, output  # printed rounded
        # One all-gather in forward, one in backward, one reduce-scatter, per unit.
        assert calls == 3.0, output


def test_hidden_fraction_counts_side_stream_time_under_compute():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step import hidden_fraction

    compute = [(0.0, 10.0), (20.0, 30.0)]  # busy longest: the compute stream
    side = {1: [(9.0, 11.0), (12.0, 16.0)], 2: [(14.0, 18.0), (20.0, 24.0)]}
    # Side time after merging: 9-11, 12-18, 20-24 = 12; under compute: 9-10 and 20-24 = 5.
    assert hidden_fraction({0: compute, **side}) == 5 / 12
    assert hidden_fraction({0: compute}) == 1.0  # nothing to hide


def test_scale_benchmark_holds_the_floors_at_a_thousand_ranks(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--worlds", "8", "1024",
         "--rank", "7", "--depth", "2", "--dim", "32", "--seq", "16", "--steps", "1",
         "--out", str(tmp_path)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    results = json.loads((tmp_path / "scale.json").read_text())
    assert [r["world_size"] for r in results] == [8, 1024]
    for r in results:
        floor, ours = r["analytic"], r["communication"]["fsdp_compose"]
        assert ours == r["communication"]["FSDP2"], r["world_size"]
        assert ours["calls"] == {"all_gather": floor["all_gather_calls"],
                                 "reduce_scatter": floor["reduce_scatter_calls"]}
        assert ours["bytes"] == {"all_gather": floor["all_gather_bytes"],
                                 "reduce_scatter": floor["reduce_scatter_bytes"]}
        peak = r["peak_memory"]["fsdp_compose"]["Total"]
        assert peak <= r["peak_memory"]["FSDP2"]["Total"], r["world_size"]
        assert peak <= floor["memory_bound"], (r["world_size"], peak, floor["memory_bound"])
    # Padded to 1024 shards, every parameter (at most 256 rows here) takes a row per rank:
    # a reduce-scatter buffer of 1024 float32 rows of each parameter's row.
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import GPT

    rows = sum(p[0].numel() for p in GPT(vocab=256, dim=32, heads=4, depth=2, seq=16).parameters())
    assert results[1]["communication"]["fsdp_compose"]["bytes"]["reduce_scatter"] == 1024 * rows * 4
