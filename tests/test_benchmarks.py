"""The benchmarks run, and what they count holds: fsdp_compose sends exactly the analytic
floor of collectives and bytes, peaks no higher in tracked memory than FSDP2, and trains
with FSDP2's and DDP's losses. (Times are the benchmarks' to report, not the tests' to
assert.) benchmarks/report.py puts their JSON's figures on docs/performance.md."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def report_page(results: Path, out: Path) -> str:
    """benchmarks/report.py on `results`, into `out`: the page, its whitespace collapsed (the
    prose is wrapped) so that phrases match whole."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    report.main(["--results", str(results), "--out", str(out)])
    return " ".join((out / "performance.md").read_text().split())


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
    assert result["config"]["machine"]["cpus"] >= 1 and result["config"]["date"]
    page = report_page(tmp_path, tmp_path / "docs")
    ms = result["step_seconds"]["fsdp_compose"] * 1e3
    assert f"| fsdp_compose | {ms:.1f} | **{result['vs_fsdp2']['fsdp_compose']:.2f}** |" in page


def test_full_state_dict_benchmark_streams_below_the_whole_model(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         str(ROOT / "benchmarks" / "full_state_dict.py"), "--dim", "256", "--depth", "2",
         "--out", str(tmp_path)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    result = json.loads((tmp_path / "full_state_dict.json").read_text())
    assert set(result["models"]) == {"example GPT", "HF Llama"}
    for name, row in result["models"].items():
        streamed = row["save_full_state_dict"]["peak_extra_mib"]
        dcp = row["DCP full state dict"]["peak_extra_mib"]
        # Streaming holds one whole tensor at a time (twice, on gloo: its all-gather stages
        # the output); DCP's full state dict holds the whole model.
        assert streamed <= 2 * row["largest_tensor_mib"] + 4, (name, row)
        assert dcp >= row["whole_mib"] > streamed, (name, row)


def test_overhead_benchmark_reports_both_runtimes_and_the_work_by_hand(tmp_path):
    output = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--units", "8",
         "--steps", "5", "--repeats", "3", "--out", str(tmp_path)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
    ).stdout
    rows = {
        name: [float(v) for v in values.split()]
        for name, values in re.findall(r"^(torch fully_shard|fsdp_compose|by hand)((?:\s+\S+){5})$",
                                       output, re.MULTILINE)
    }
    # The benchmark checked the work by hand against fsdp_compose's gradients, or it failed.
    assert sorted(rows) == ["by hand", "fsdp_compose", "torch fully_shard"], output
    for step_ms, per_unit, in_collectives, runtime, calls in rows.values():
        assert step_ms > 0 and in_collectives > 0, output
        assert abs(per_unit - in_collectives - runtime) <= 0.11, output  # printed rounded
        # One all-gather in forward, one in backward, one reduce-scatter, per unit.
        assert calls == 3.0, output
    # The JSON holds what was printed, under the backend's name.
    saved = json.loads((tmp_path / "overhead.json").read_text())
    assert list(saved) == ["fake"] and saved["fake"]["config"]["world_size"] == 8
    for name, (step_ms, per_unit, in_collectives, _runtime, calls) in rows.items():
        variant = saved["fake"]["variants"][name]
        assert f"{variant['step_seconds'] * 1e3:.2f}" == f"{step_ms:.2f}", (variant, output)
        assert f"{variant['us_per_unit']:.1f}" == f"{per_unit:.1f}", (variant, output)
        assert f"{variant['collectives_us_per_unit']:.1f}" == f"{in_collectives:.1f}", \
            (variant, output)
        assert variant["calls_per_unit"] == calls and len(variant["step_samples"]) == 3


def test_overhead_benchmark_times_transformer_blocks_with_an_optimizer(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--block", "transformer",
         "--optimizer", "--units", "2", "--steps", "2", "--repeats", "1", "--out", str(tmp_path)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    saved = json.loads((tmp_path / "overhead.json").read_text())  # beside the default's key
    v = saved["fake, transformer + AdamW"]["variants"]
    # One all-gather call per gather of 12 parameters, as FSDP2 makes.
    assert [v[n]["calls_per_unit"] for n in ("torch fully_shard", "fsdp_compose", "by hand")] \
        == [3.0] * 3
    ours = v["fsdp_compose"]["vs_fsdp2"]
    assert ours == v["fsdp_compose"]["us_per_unit"] / v["torch fully_shard"]["us_per_unit"]
    (tmp_path / "overhead.json").write_text(
        json.dumps({"fake": synthetic_overhead()["fake"], **saved}))
    page = report_page(tmp_path, tmp_path / "docs")  # below the default run's table
    assert "| | 2 × transformer block + AdamW |" in page and f"| ratio | {ours:.3f} |" in page


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
    saved = json.loads((tmp_path / "scale.json").read_text())
    results = saved["worlds"]
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

    model = GPT(vocab=256, dim=32, heads=4, depth=2, seq=16)
    rows = sum(p[0].numel() for p in model.parameters())
    assert results[1]["communication"]["fsdp_compose"]["bytes"]["reduce_scatter"] \
        == 1024 * rows * 4
    assert saved["config"]["largest_rows"] == 256  # the embedding's and the head's vocab rows
    page = report_page(tmp_path, tmp_path / "docs")
    gathered = results[1]["communication"]["fsdp_compose"]["bytes"]["all_gather"]
    peak = results[1]["peak_memory"]["fsdp_compose"]["Total"]
    assert f"| 1024 | {peak / 1024:,.0f} KiB |" in page
    assert f"| {gathered:,} B |" in page


# benchmarks/report.py on results made up for the purpose (the figures of README's tables).

PROVENANCE = {
    "date": "2025-01-02T03:04:05+00:00", "torch": "2.13.0+cpu", "python": "3.11.7",
    "machine": {"platform": "Linux-test", "cpu": "Test CPU 9000", "cpus": 2, "gpu": None},
    "argv": [],
}
KiB = 1024
MODEL = {"model": "gpt", "depth": 8, "dim": 128, "seq": 64, "batch": 8, "heads": 4, "vocab": 256,
         "dtype": "torch.float32", "mixed_precision": False, "compile": False,
         "compile_backend": "inductor"}


def synthetic_step() -> dict:
    seconds = {"fsdp_compose": 0.1832, "FSDP2": 0.2148, "DDP": 0.1156, "floor": 0.1027}
    totals = {"fsdp_compose": 46_772, "FSDP2": 46_772, "DDP": 56_040, "floor": 55_048}
    sharded = {"calls": {"all_gather": 17, "reduce_scatter": 9},
               "bytes": {"all_gather": 12_985_344, "reduce_scatter": 6_640_640}}
    return {
        "config": {**MODEL, "steps": 5, "rounds": 7, "warmup": 1, "world_size": 2,
                   "device": "cpu", "backend": "gloo", **PROVENANCE, "wall_seconds": 181.0},
        "step_seconds": seconds, "host_seconds": {n: t - 0.003 for n, t in seconds.items()},
        "vs_fsdp2": {n: t / seconds["FSDP2"] for n, t in seconds.items()},
        "vs_floor": {n: t / seconds["floor"] for n, t in seconds.items()},
        "peak_memory": {n: {"Parameter": 1000 * KiB, "Activation": (t - 1000) * KiB,
                            "Total": t * KiB} for n, t in totals.items()},
        "analytic": {"all_gather_bytes": 12_985_344, "reduce_scatter_bytes": 6_640_640,
                     "all_gather_calls": 17, "reduce_scatter_calls": 9,
                     "ddp_all_reduce_bytes": 3_279_872, "memory_bound": 51_400 * KiB,
                     "copy_gather_bytes": 0, "copy_param_cast_bytes": 0,
                     "copy_grad_cast_bytes": 0, "copy_bytes": 0,
                     "copy_one_reduce_scatter_bytes": 6_640_640},
        "communication": {"fsdp_compose": sharded, "FSDP2": sharded,
                          "DDP": {"calls": {}, "bytes": {"all_reduce": 3_279_872}}},
        "copies": {n: {"calls": {"clone": 1}, "bytes": {"clone": 1_000, "_chunk_cat": extra},
                       "total_bytes": 1_000 + extra}
                   for n, extra in (("fsdp_compose", 6_640_640), ("FSDP2", 19_625_984),
                                    ("DDP", 0), ("floor", 0), ("model", 0))},
        "max_loss_difference_vs_fsdp2": {"fsdp_compose": 0.0, "DDP": 0.0},
        "mfu": None, "hidden_communication": None,
    }


def synthetic_overhead() -> dict:
    def variant(per_unit: float, collectives: float, calls: float,
                above_floor: list[float]) -> dict:
        return {"step_seconds": 0.01 + statistics.median(above_floor),
                "step_samples": [0.01 + t for t in above_floor], "us_per_unit": per_unit,
                "collectives_us_per_unit": collectives,
                "runtime_us_per_unit": per_unit - collectives,
                "collective_samples": [collectives * 64e-6] * 3, "calls_per_unit": calls}

    def backend(world: int, ours: tuple, theirs: tuple, by_hand: tuple) -> dict:
        config = {"backend": "fake" if world > 1 else "gloo", "world": world,
                  "world_size": world, "units": 64, "dim": 64, "batch": 8, "seq": 16,
                  "block": "linear", "optimizer": False, "steps": 20, "repeats": 3,
                  **PROVENANCE}
        return {"config": config, "variants": {"unsharded": variant(0.0, 0.0, 0.0, [0.0] * 3),
                                               "torch fully_shard": variant(*theirs),
                                               "fsdp_compose": variant(*ours),
                                               "after a StepTrace": variant(*ours),
                                               "by hand": variant(*by_hand)}}

    # Per round, fsdp_compose's time above the unsharded model's is 0.160 to 0.163 of FSDP2's.
    return {"fake": backend(8, (188.4, 51.6, 3.0, [0.0120, 0.0121, 0.0122]),
                            (1171.2, 63.4, 3.0, [0.075] * 3), (150.7, 52.0, 3.0, [0.0096] * 3)),
            "gloo": backend(1, (120.3, 0.0, 0.0, [0.0077] * 3), (671.0, 0.0, 0.0, [0.043] * 3),
                            (90.0, 0.0, 0.0, [0.0058] * 3))}


def synthetic_scale() -> dict:
    def world(size: int, peak: int, bound: int, gathered: int, reduced: int, ours: list[float],
              theirs: list[float]) -> dict:
        sent = {"calls": {"all_gather": 17, "reduce_scatter": 9},
                "bytes": {"all_gather": gathered, "reduce_scatter": reduced}}
        return {"world_size": size,
                "step_seconds": {"fsdp_compose": statistics.median(ours),
                                 "FSDP2": statistics.median(theirs)},
                "step_samples": {"fsdp_compose": ours, "FSDP2": theirs},
                "communication": {"fsdp_compose": sent, "FSDP2": sent},
                "peak_memory": {n: {"Total": peak * KiB}
                                for n in ("fsdp_compose", "FSDP2", "floor")},
                "analytic": {"all_gather_bytes": gathered, "reduce_scatter_bytes": reduced,
                             "all_gather_calls": 17, "reduce_scatter_calls": 9,
                             "ddp_all_reduce_bytes": 3_279_872, "memory_bound": bound * KiB}}

    config = {**MODEL, "worlds": [8, 1024], "rank": 0, "steps": 3, "device": "cpu",
              "backend": "fake", **PROVENANCE, "largest_rows": 512, "wall_seconds": 40.0}
    return {"config": config, "worlds": [
        world(8, 39_476, 41_000, 12_985_344, 6_640_640, [0.1302, 0.1290, 0.1310],
              [0.1400, 0.1390, 0.1410]),
        world(1024, 44_072, 47_900, 60_825_600, 31_203_328, [0.2213, 0.2000, 0.2434],
              [0.2000, 0.1900, 0.2100]),
    ]}


def synthetic_full_state_dict() -> dict:
    row = {"whole_mib": 221.7, "largest_tensor_mib": 62.5,
           "save_full_state_dict": {"peak_extra_mib": 125.1, "seconds": 1.0},
           "DCP full state dict": {"peak_extra_mib": 284.5, "seconds": 1.0}}
    config = {"world_size": 2, "argv": [], "date": "2026-11-25T12:00:00+00:00",
              "torch": "2.13.0+cpu", "python": "3.11.7",
              "machine": {"platform": "Linux", "cpu": "AMD EPYC", "cpus": 2, "gpu": None}}
    return {"config": config, "models": {"example GPT": row}}


def synthetic_optimizer() -> dict:
    config = {**synthetic_full_state_dict()["config"], "dims": [64, 256], "world": 8, "rounds": 9}
    steps = {"fsdp_compose": 2.0, "FSDP2": 2.1, "plain": 1.0}
    return {"config": config, "ms_per_step": {
        "dim 64": {"none": {"foreach": steps}},
        "dim 256": {"none": {"foreach": steps, "fused": {**steps, "FSDP2": 1.9}}}}}


def synthetic_weights() -> dict:
    config = {**synthetic_full_state_dict()["config"], "world": 2}
    way = {"ms": 10.0, "collectives": 16, "peak MiB": 4.0}
    ways = {name: way for name in ("out: full_tensor() loop", "out: DCP get_model_state_dict",
                                   "in: DCP set_model_state_dict")}
    return {"config": config, "results": {model: {
        **ways, "out: iter_full_state_dict": {**way, "ms": 2.5, "collectives": 4},
        "in: load_full_state_dict(pairs)": {**way, "collectives": 2}}
        for model in ("many small", "few large")}}


def write_results(folder: Path, **results: dict) -> Path:
    folder.mkdir()
    for name, result in results.items():
        (folder / f"{name}.json").write_text(json.dumps(result))
    return folder


def test_report_puts_the_results_figures_on_the_page(tmp_path, capsys):
    results = write_results(tmp_path / "results", step=synthetic_step(),
                            overhead=synthetic_overhead(), scale=synthetic_scale(),
                            full_state_dict=synthetic_full_state_dict(),
                            optimizer=synthetic_optimizer(), weights=synthetic_weights())
    page = report_page(results, tmp_path / "docs")
    assert "missing" not in capsys.readouterr().out
    # Weights out and in: each way's figures, its ratio to the loop.
    assert "| many small | out: iter_full_state_dict | 2.5 | 0.25 | 4 | 4.00 MiB |" in page
    # The optimizer step: by policy and AdamW variant, with both ratios.
    for said in ("| 64 | none | foreach | 2.00 | 2.10 | 1.00 | 2.00 | 0.95 |",
                 "| 256 | none | fused | 2.00 | 1.90 | 1.00 | 2.00 | 1.05 |",
                 "8 blocks (dim 64 and 256, 12 parameters"):
        assert said in page, said
    # Whole checkpoints: rank 0's peaks and their ratio.
    assert "| example GPT | 221.7 MiB | 62.5 MiB | 125.1 MiB | 284.5 MiB | **0.44** |" in page
    # Step: the table (with the losses' largest difference from FSDP2's), the bytes against
    # the floor, what the run was on, and the statements made from the figures.
    for row in ("| fsdp_compose | 183.2 | **0.85** | 1.78 | 46,772 KiB | 0.91 | 180.2 | 0 |",
                "| FSDP2 | 214.8 | 1.00 | 2.09 | 46,772 KiB | 0.91 | 211.8 | |",
                "| DDP | 115.6 | 0.54 | 1.13 | 56,040 KiB | 1.09 | 112.6 | 0 |",
                "| floor | 102.7 | 0.48 | 1.00 | 55,048 KiB | 1.07 | 99.7 | |",
                "| fsdp_compose | 6,640,640 | 1,000 | 6,641,640 | 6,640,640 |",
                "| floor, one reduce-scatter per unit | | | | 6,640,640 |",
                "| fsdp_compose | 17 | 12,985,344 | 9 | 6,640,640 | – |",
                "| DDP | – | – | – | – | 3,279,872 |",
                "| analytic floor | 17 | 12,985,344 | 9 | 6,640,640 | 3,279,872 (DDP) |"):
        assert row in page, row
    for said in ("2 ranks on a 2-core CPU machine (gloo), median of 7 rounds of 5 steps "
                 "(2025-01-02 03:04 UTC, torch 2.13.0+cpu, Python 3.11.7, Test CPU 9000 (2 cores), "
                 "Linux-test)",
                 "# CPU, gloo: about 3 minutes",
                 "(8 blocks, dim 128, seq 64, batch 8 per rank, AdamW)",
                 "fsdp_compose sends exactly the floor; FSDP2 the same.",
                 "against the analytic bound of 51,400 KiB",
                 "On a GPU the step table adds MFU"):
        assert said in page, said
    # CPU time per unit, both backends.
    for said in ("| | fake, W=8 | in collectives | runtime's own | gloo, 1 rank |",
                 "| fsdp_compose | 188 µs | 52 µs | 137 µs | 120 µs |",
                 "| torch's fully_shard | 1,171 µs | 63 µs | 1,108 µs | 671 µs |",
                 "| by hand | 151 µs | 52 µs | 99 µs | 90 µs |",
                 "| ratio | 0.161 | | 0.12 | 0.18 |",
                 "about the least a runtime of this design can cost",
                 "Across the 3 rounds the ratio on the fake group ranges from 0.160 to 0.163.",
                 "The goal of 100 µs per unit, set where FSDP2 costs 580 µs, is a ratio of 0.172: "
                 "fsdp_compose's 0.161 is within it.",
                 "Both runtimes make the same three calls per unit",
                 "first costs 188 µs per unit against 188 µs: a closed trace leaves nothing"):
        assert said in page, said
    # Scale.
    for said in ("| 8 | 39,476 KiB | 39,476 KiB | 0.96 | 12,985,344 B | 6,640,640 B | yes | 130.2 "
                 "| 140.0 |",
                 "| 1024 | 44,072 KiB | 44,072 KiB | 0.92 | 60,825,600 B | 31,203,328 B | yes | "
                 "221.3 | 200.0 |",
                 "| = floor = FSDP2 |",
                 "# W = 8, 1024: 40 s",
                 "largest dimension 512 rows",
                 "at W = 1024 a runtime's timed steps lie within ±10% of their median"):
        assert said in page, said
    chart = tmp_path / "docs" / "performance.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "](performance.png)" in page
    else:
        assert not chart.exists() and "](performance.png)" not in page


def test_report_leaves_out_what_is_missing(tmp_path, capsys, monkeypatch):
    results = write_results(tmp_path / "results", step=synthetic_step(), scale=synthetic_scale())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    page = report_page(results, tmp_path / "docs")
    out = capsys.readouterr().out
    assert f"missing {results / 'overhead.json'}" in out and "matplotlib not installed" in out
    assert f"Not on this page yet: overhead (no `{results / 'overhead'}.json`" in page
    assert "## Training step" in page and "## Scale" in page and "## CPU time per unit" not in page
    assert "| fsdp_compose | 183.2 | **0.85** | 1.78 | 46,772 KiB | 0.91 |" in page
    assert "](performance.png)" not in page
    assert not (tmp_path / "docs" / "performance.png").exists()


def test_weights_benchmark_counts_one_gather_per_unit_against_one_per_tensor(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "weights.py"), "--fake", "4",
                    "--rounds", "1", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    small = json.loads((tmp_path / "weights_fake.json").read_text())["results"]["many small"]
    assert small["out: iter_full_state_dict"]["collectives"] == 64  # a unit per block
    # 4 tensors per block, each full_tensor() dispatching two collective ops here
    assert small["out: full_tensor() loop"]["collectives"] == 4 * 64 * 2
    assert small["in: DCP set_model_state_dict"]["peak MiB"] \
        >= small["in: load_full_state_dict(pairs)"]["peak MiB"]
