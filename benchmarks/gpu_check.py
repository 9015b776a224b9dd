"""Every GPU check in one command, for a machine with one GPU, its own torch and no network
(CONTRIBUTING.md, "GPU"), and the same sequence on tiny sizes on the CPU:

    python benchmarks/gpu_check.py --out DIR         # one GPU: under 8 minutes on an H100
    python benchmarks/gpu_check.py --cpu --out DIR   # the CPU: tiny sizes, a few minutes

In order:
1. the GPU test files: tests/test_cuda.py (one NCCL rank) and tests/test_cuda_ranks.py (2 and
   4 ranks sharing the GPU over gloo); with --cpu, the ranks' dry run on the CPU
   (FSDP_COMPOSE_TEST_DEVICE=cpu) while tests/test_cuda.py skips;
2. benchmarks/step.py on one rank: the ~1B Llama with a bf16 policy, eager, then each block
   compiled (--cpu: the aot_eager backend), then the example GPT at 230M in bf16;
3. benchmarks/optimizer.py: AdamW's step alone (for-loop, foreach, fused) over our
   parameters, FSDP2's and plain tensors of the same shards (--cpu: dim 64, one round);
4. one summary in DIR, summary.md and summary.json: pass or fail per test; per benchmark
   and contender the step and host time, MFU, the allocator's step peak (CUDA) and the
   bytes copied beyond the model's own; and the deterministic loss comparison: ours
   against FSDP2, beside FSDP2 against itself (the run-to-run noise); the optimizer's
   step against plain tensors', ours and FSDP2's.

The exit status is 0 when every test passed (or skipped for want of a GPU), every benchmark
ran, its loss fell, and ours differed from FSDP2's by no more than twice FSDP2's own noise
(so exactly 0.0 wherever FSDP2 repeats itself exactly, as on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_FILES = ("tests/test_cuda.py", "tests/test_cuda_ranks.py")

# Sizes per machine. GPU: the figures of the project's GPU issues (H100, one rank).
LLAMA = {
    "gpu": ["--dim", "2048", "--depth", "16", "--seq", "2048", "--batch", "4", "--heads", "16",
            "--vocab", "32768"],
    "cpu": ["--dim", "64", "--depth", "2", "--seq", "32", "--batch", "2", "--heads", "4",
            "--vocab", "128", "--steps", "2", "--rounds", "1", "--warmup", "0",
            "--parity-steps", "8", "--parity-lr", "1e-3"],  # a tiny model learns faster
}
GPT = {
    "gpu": ["--dim", "1024", "--depth", "16", "--seq", "1024", "--batch", "8", "--heads", "16",
            "--vocab", "32768"],
    "cpu": LLAMA["cpu"],
}
PEAK_TFLOPS = {"H100": 989, "H200": 989}  # dense bf16, for MFU


def benchmarks(machine: str, peak_tflops: float | None) -> dict[str, list[str]]:
    """benchmarks/step.py's arguments per run, by name."""
    peak = [] if peak_tflops is None else ["--peak-tflops", str(peak_tflops)]
    compile_backend = ["--compile-backend", "aot_eager"] if machine == "cpu" else []
    llama = ["--model", "llama", *LLAMA[machine], "--mixed-precision", *peak]
    return {
        "llama eager": llama,
        "llama compiled": [*llama, "--compile", *compile_backend],
        "gpt bf16": ["--model", "gpt", *GPT[machine], "--dtype", "bfloat16", *peak],
    }


def run_tests(out: Path, machine: str, timeout: float) -> dict:
    """Both GPU test files in one pytest run; each test's outcome from its JUnit report."""
    report = out / "tests.xml"
    env = {**os.environ, **({"FSDP_COMPOSE_TEST_DEVICE": "cpu"} if machine == "cpu" else {})}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *TEST_FILES, "-q", f"--junitxml={report}"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        )
        log, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        log, code = f"timed out after {timeout:.0f} s\n{expired.stdout or ''}", -1
    (out / "tests.log").write_text(log)
    outcomes = junit_outcomes(report) if report.exists() else {}
    return {"seconds": time.perf_counter() - start, "exit_code": code, "outcomes": outcomes}


def junit_outcomes(report: Path) -> dict[str, str]:
    """`file::test[params]`: passed, failed, error or skipped (with pytest's reason)."""
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag if child.tag == "error" else "failed"
            elif child.tag == "skipped":
                outcome = f"skipped: {child.get('message', '')}"
        outcomes[name] = outcome
    return outcomes


OPTIMIZER = {"gpu": ["--rounds", "9", "--calls", "5"], "cpu": ["--dims", "64", "--rounds", "1", "--calls", "1"]}


def run_step(name: str, args: list[str], out: Path, timeout: float) -> dict:
    """benchmarks/step.py on one rank; its JSON, or why there is none."""
    command = ["-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/step.py", *args]
    return run_benchmark(command, out / name.replace(" ", "_"), "step.json", timeout)


def run_benchmark(command: list[str], folder: Path, result: str, timeout: float) -> dict:
    """One benchmark writing `result` into `folder`; its JSON, or why there is none."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *command, "--out", str(folder)],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        log = done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        log, done = f"timed out after {timeout:.0f} s\n{expired.stdout or ''}", None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log.txt").write_text(log)
    seconds = time.perf_counter() - start
    if done is None or done.returncode != 0 or not (folder / result).exists():
        return {"seconds": seconds, "error": log[-3000:]}
    return {"seconds": seconds, "result": json.loads((folder / result).read_text())}


def optimizer_rows(run: dict) -> dict:
    """Per dim, policy and AdamW variant: ms per step and the ratios to plain tensors'."""
    if "error" in run:
        return {"ok": False, **run}
    rows = {f"{dim.removeprefix('dim ')}, {policy}, {variant}": {
                **ms, "ours_vs_plain": ms["fsdp_compose"] / ms["plain"], "fsdp2_vs_plain": ms["FSDP2"] / ms["plain"]}
            for dim, steps in run["result"]["ms_per_step"].items()
            for policy, by_variant in steps.items() for variant, ms in by_variant.items()}
    return {"ok": True, "seconds": run["seconds"], "rows": rows}


def contender_rows(result: dict) -> dict[str, dict]:
    """Per contender: what the summary's tables show."""
    copies, model_bytes = result["copies"], result["copies"]["model"]["total_bytes"]
    rows = {}
    for name, step in result["step_seconds"].items():
        memory = result["peak_memory"][name]
        rows[name] = {
            "step_ms": step * 1e3,
            "host_ms": result["host_seconds"][name] * 1e3,
            "vs_fsdp2": result["vs_fsdp2"][name],
            "mfu": (result.get("mfu") or {}).get(name),
            "allocator_step_peak_mib": memory.get("allocator step peak", 0) / 2**20 or None,
            "tracked_peak_mib": memory["Total"] / 2**20,
            "copied_beyond_model_mib": (copies[name]["total_bytes"] - model_bytes) / 2**20,
        }
    return rows


def loss_verdict(parity: dict) -> dict:
    """Ours against FSDP2, read against FSDP2 against itself."""
    ours = parity["max_difference_vs_fsdp2"]["fsdp_compose"]
    noise = parity["max_difference_vs_fsdp2"]["FSDP2 again"]
    within = ours <= 2 * noise
    return {"ours_vs_fsdp2": ours, "fsdp2_vs_fsdp2": noise, "within_noise": within,
            "loss_falls": parity["loss_falls"], "ok": within and parity["loss_falls"]}


def summarise(tests: dict, steps: dict[str, dict], optimizer: dict, machine: str) -> dict:
    benches = {}
    for name, run in steps.items():
        if "error" in run:
            benches[name] = {"ok": False, "seconds": run["seconds"], "error": run["error"]}
            continue
        result = run["result"]
        verdict = loss_verdict(result["loss_parity"])
        benches[name] = {"ok": verdict["ok"], "seconds": run["seconds"],
                         "contenders": contender_rows(result), "loss_parity": verdict,
                         "losses": result["loss_parity"]["losses"], "device": result["config"]["device"]}
    failed = [n for n, o in tests["outcomes"].items() if o in ("failed", "error")]
    tests_ok = bool(tests["outcomes"]) and not failed and tests["exit_code"] in (0, 5)
    return {"machine": machine, "tests": {**tests, "failed": failed, "ok": tests_ok},
            "benchmarks": benches, "optimizer": optimizer,
            "ok": tests_ok and all(b["ok"] for b in benches.values()) and optimizer["ok"]}


def markdown(summary: dict) -> str:
    tests = summary["tests"]
    lines = [f"# GPU check ({summary['machine']}): {'PASS' if summary['ok'] else 'FAIL'}", "",
             f"## Tests: {len(tests['outcomes'])} in {tests['seconds']:.0f} s, "
             f"{len(tests['failed'])} failed", "", "| test | outcome |", "|---|---|"]
    lines += [f"| `{name}` | {outcome} |" for name, outcome in tests["outcomes"].items()]
    for name, bench in summary["benchmarks"].items():
        lines += ["", f"## {name} ({bench['seconds']:.0f} s)", ""]
        if "error" in bench:
            lines += ["```", bench["error"], "```"]
            continue
        lines += ["| contender | step ms | host ms | vs FSDP2 | MFU | allocator step peak MiB "
                  "| tracked peak MiB | copied beyond model MiB |", "|---|---|---|---|---|---|---|---|"]
        for who, row in bench["contenders"].items():
            cells = [f"{row['step_ms']:.1f}", f"{row['host_ms']:.1f}", f"{row['vs_fsdp2']:.2f}",
                     "-" if row["mfu"] is None else f"{row['mfu']:.3f}",
                     "-" if row["allocator_step_peak_mib"] is None else f"{row['allocator_step_peak_mib']:.0f}",
                     f"{row['tracked_peak_mib']:.0f}", f"{row['copied_beyond_model_mib']:.1f}"]
            lines.append(f"| {who} | " + " | ".join(cells) + " |")
        parity, losses = bench["loss_parity"], bench["losses"]["FSDP2"]
        lines += ["", f"Loss parity, deterministic: FSDP2's loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
                  f"max |loss - FSDP2's|: fsdp_compose {parity['ours_vs_fsdp2']:.3g}, FSDP2 again "
                  f"{parity['fsdp2_vs_fsdp2']:.3g} ({'within' if parity['within_noise'] else 'ABOVE'} "
                  "FSDP2's own noise)."]
    return "\n".join(lines + optimizer_markdown(summary["optimizer"])) + "\n"


def optimizer_markdown(optimizer: dict) -> list[str]:
    lines = ["", "## AdamW's step alone (benchmarks/optimizer.py)", ""]
    if "error" in optimizer:
        return [*lines, "```", optimizer["error"], "```"]
    lines += ["| dim, policy, AdamW | fsdp_compose ms | FSDP2 ms | plain ms | ours / plain | FSDP2 / plain |",
              "|---|---|---|---|---|---|"]
    return lines + [f"| {name} | {row['fsdp_compose']:.2f} | {row['FSDP2']:.2f} | {row['plain']:.2f} | "
                    f"{row['ours_vs_plain']:.2f} | {row['fsdp2_vs_plain']:.2f} |"
                    for name, row in optimizer["rows"].items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="the same sequence, tiny, on the CPU")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak (default: by its name)")
    parser.add_argument("--tests-timeout", type=float, default=300)
    parser.add_argument("--step-timeout", type=float, default=360)
    args = parser.parse_args(argv)
    import torch

    machine = "cpu" if args.cpu else "gpu"
    if machine == "gpu" and not torch.cuda.is_available():
        parser.error("no GPU here: pass --cpu for the dry run")
    peak = args.peak_tflops
    if peak is None and machine == "gpu":
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    args.out.mkdir(parents=True, exist_ok=True)
    tests = run_tests(args.out, machine, args.tests_timeout)
    print(f"tests: {tests['exit_code']=} in {tests['seconds']:.0f} s", flush=True)
    steps = {}
    for name, step_args in benchmarks(machine, peak).items():
        steps[name] = run_step(name, step_args, args.out, args.step_timeout)
        print(f"{name}: {'ok' if 'result' in steps[name] else 'FAILED'} in "
              f"{steps[name]['seconds']:.0f} s", flush=True)
    optimizer = optimizer_rows(run_benchmark(
        ["benchmarks/optimizer.py", *OPTIMIZER[machine]], args.out / "optimizer", "optimizer.json", args.step_timeout))
    print(f"optimizer: {'ok' if optimizer['ok'] else 'FAILED'}", flush=True)
    summary = summarise(tests, steps, optimizer, machine)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
