"""Every GPU check in one command, for a machine with one GPU, its own torch and no network
(CONTRIBUTING.md, "GPU"), and the same sequence on tiny sizes on the CPU:

    python benchmarks/gpu_check.py --out DIR         # one GPU: under 8 minutes on an H100
    python benchmarks/gpu_check.py --cpu --out DIR   # the CPU: tiny sizes, a few minutes

In order: the GPU test files (tests/test_cuda.py, one NCCL rank; tests/test_cuda_ranks.py, 2
and 4 ranks sharing the GPU over gloo, which --cpu runs on the CPU); benchmarks/step.py on one
rank for the ~1B Llama with a bf16 policy, eager and then each block compiled (--cpu: with
aot_eager), and for the example GPT at 230M in bf16; benchmarks/optimizer.py. Then one summary
in DIR, summary.md and summary.json: pass or fail per test; per benchmark and contender the
step and host time, MFU, the allocator's step peak (CUDA) and the bytes copied beyond the
model's own; the deterministic loss comparison, ours against FSDP2 beside FSDP2 against itself
(the run-to-run noise); the optimizer's step against plain tensors', ours and FSDP2's.

The exit status is 0 when every test passed (or skipped for want of a GPU), every benchmark
ran, its loss fell, and ours differed from FSDP2's by no more than twice FSDP2's own noise (so
exactly 0.0 wherever FSDP2 repeats itself exactly, as on the CPU).
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

from report import table

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
OPTIMIZER = {"gpu": ["--rounds", "9", "--calls", "5"],
             "cpu": ["--dims", "64", "--rounds", "1", "--calls", "1"]}
PEAK_TFLOPS = {"H100": 989, "H200": 989}  # dense bf16, for MFU


def step_runs(machine: str, peak_tflops: float | None) -> dict[str, list[str]]:
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
    junit = out / "tests.xml"
    env = {**os.environ, **({"FSDP_COMPOSE_TEST_DEVICE": "cpu"} if machine == "cpu" else {})}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *TEST_FILES, "-q", f"--junitxml={junit}"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        log, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        log, code = f"timed out after {timeout:.0f} s\n{expired.stdout or ''}", -1
    (out / "tests.log").write_text(log)
    outcomes = junit_outcomes(junit) if junit.exists() else {}
    return {"seconds": time.perf_counter() - start, "exit_code": code, "outcomes": outcomes}


def junit_outcomes(junit: Path) -> dict[str, str]:
    """`file::test[params]`: passed, failed, error or skipped (with pytest's reason)."""
    outcomes = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = f"skipped: {child.get('message', '')}"
        outcomes[f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"] = outcome
    return outcomes


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
                **ms, "ours_vs_plain": ms["fsdp_compose"] / ms["plain"],
                "fsdp2_vs_plain": ms["FSDP2"] / ms["plain"]}
            for dim, steps in run["result"]["ms_per_step"].items()
            for policy, by_variant in steps.items() for variant, ms in by_variant.items()}
    return {"ok": True, "seconds": run["seconds"], "rows": rows}


def step_summary(run: dict) -> dict:
    """Per contender what the summary's tables show, and the loss comparison: ours against
    FSDP2, read against FSDP2 against itself."""
    if "error" in run:
        return {"ok": False, **run}
    result = run["result"]
    copies, model_bytes = result["copies"], result["copies"]["model"]["total_bytes"]
    contenders = {}
    for name, step in result["step_seconds"].items():
        memory = result["peak_memory"][name]
        contenders[name] = {
            "step_ms": step * 1e3, "host_ms": result["host_seconds"][name] * 1e3,
            "vs_fsdp2": result["vs_fsdp2"][name], "mfu": (result.get("mfu") or {}).get(name),
            "allocator_step_peak_mib": memory.get("allocator step peak", 0) / 2**20 or None,
            "tracked_peak_mib": memory["Total"] / 2**20,
            "copied_beyond_model_mib": (copies[name]["total_bytes"] - model_bytes) / 2**20,
        }
    parity = result["loss_parity"]
    ours, noise = (parity["max_difference_vs_fsdp2"][n] for n in ("fsdp_compose", "FSDP2 again"))
    verdict = {"ours_vs_fsdp2": ours, "fsdp2_vs_fsdp2": noise, "within_noise": ours <= 2 * noise,
               "loss_falls": parity["loss_falls"], "ok": ours <= 2 * noise and parity["loss_falls"]}
    return {"ok": verdict["ok"], "seconds": run["seconds"],
            "contenders": contenders, "loss_parity": verdict, "losses": parity["losses"],
            "device": result["config"]["device"]}


def summarise(tests: dict, steps: dict[str, dict], optimizer: dict, machine: str) -> dict:
    failed = [n for n, o in tests["outcomes"].items() if o in ("failed", "error")]
    tests_ok = bool(tests["outcomes"]) and not failed and tests["exit_code"] in (0, 5)
    benches = {name: step_summary(run) for name, run in steps.items()}
    return {"machine": machine, "tests": {**tests, "failed": failed, "ok": tests_ok},
            "benchmarks": benches, "optimizer": optimizer,
            "ok": tests_ok and all(b["ok"] for b in benches.values()) and optimizer["ok"]}


def markdown(summary: dict) -> str:
    tests = summary["tests"]
    lines = [f"# GPU check ({summary['machine']}): {'PASS' if summary['ok'] else 'FAIL'}", "",
             f"## Tests: {len(tests['outcomes'])} in {tests['seconds']:.0f} s, "
             f"{len(tests['failed'])} failed", "",
             table(["test", "outcome"], "ll",
                   [[f"`{name}`", outcome] for name, outcome in tests["outcomes"].items()])]
    for name, bench in summary["benchmarks"].items():
        lines += ["", f"## {name} ({bench['seconds']:.0f} s)", ""]
        if "error" in bench:
            lines += ["```", bench["error"], "```"]
            continue
        rows = [[who, f"{row['step_ms']:.1f}", f"{row['host_ms']:.1f}", f"{row['vs_fsdp2']:.2f}",
                 "-" if row["mfu"] is None else f"{row['mfu']:.3f}",
                 "-" if row["allocator_step_peak_mib"] is None
                 else f"{row['allocator_step_peak_mib']:.0f}",
                 f"{row['tracked_peak_mib']:.0f}", f"{row['copied_beyond_model_mib']:.1f}"]
                for who, row in bench["contenders"].items()]
        lines.append(table(["contender", "step ms", "host ms", "vs FSDP2", "MFU",
                            "allocator step peak MiB", "tracked peak MiB",
                            "copied beyond model MiB"], "llllllll", rows))
        parity, losses = bench["loss_parity"], bench["losses"]["FSDP2"]
        lines += ["", f"Loss parity, deterministic: FSDP2's loss {losses[0]:.4f} -> "
                  f"{losses[-1]:.4f}; max |loss - FSDP2's|: fsdp_compose "
                  f"{parity['ours_vs_fsdp2']:.3g}, FSDP2 again {parity['fsdp2_vs_fsdp2']:.3g} "
                  f"({'within' if parity['within_noise'] else 'ABOVE'} FSDP2's own noise)."]
    optimizer = summary["optimizer"]
    lines += ["", "## AdamW's step alone (benchmarks/optimizer.py)", ""]
    if "error" in optimizer:
        lines += ["```", optimizer["error"], "```"]
    else:
        lines.append(table(
            ["dim, policy, AdamW", "fsdp_compose ms", "FSDP2 ms", "plain ms", "ours / plain",
             "FSDP2 / plain"], "llllll",
            [[name, *(f"{row[k]:.2f}" for k in ("fsdp_compose", "FSDP2", "plain",
                                                "ours_vs_plain", "fsdp2_vs_plain"))]
             for name, row in optimizer["rows"].items()]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="the same sequence, tiny, on the CPU")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak (default: by its name)")
    parser.add_argument("--tests-timeout", type=float, default=300)
    parser.add_argument("--step-timeout", type=float, default=360)
    args = parser.parse_args(argv)
    import torch  # after the arguments: --help needs no torch

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
    for name, step_args in step_runs(machine, peak).items():
        command = ["-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/step.py",
                   *step_args]
        steps[name] = run_benchmark(command, args.out / name.replace(" ", "_"), "step.json",
                                    args.step_timeout)
        print(f"{name}: {'ok' if 'result' in steps[name] else 'FAILED'} in "
              f"{steps[name]['seconds']:.0f} s", flush=True)
    optimizer = optimizer_rows(run_benchmark(["benchmarks/optimizer.py", *OPTIMIZER[machine]],
                                             args.out / "optimizer", "optimizer.json",
                                             args.step_timeout))
    print(f"optimizer: {'ok' if optimizer['ok'] else 'FAILED'}", flush=True)
    summary = summarise(tests, steps, optimizer, machine)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
