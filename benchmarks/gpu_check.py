"""Every GPU check in one command, for a machine with one GPU, its own torch and no network
(CONTRIBUTING.md, "GPU"), and the same sequence on tiny sizes on the CPU:

    python benchmarks/gpu_check.py --out DIR         # one GPU: under 8 minutes on an H100
    python benchmarks/gpu_check.py --cpu --out DIR   # the CPU: tiny sizes, a few minutes

tests/test_cuda.py and tests/test_cuda_ranks.py; step.py on one rank for the ~1B Llama (bf16
policy; eager, then each block compiled) and the 230M example GPT in bf16; optimizer.py. DIR
gets summary.md and summary.json: each test's outcome; per benchmark and contender the step and
host time, MFU, the allocator's step peak, the bytes copied beyond the model's own and the
deterministic loss comparison; AdamW's step against plain tensors'. Exit status 0 when every
test passed (or skipped for want of a GPU), every benchmark ran, its loss fell, and ours
differed from FSDP2's by no more than twice FSDP2's own run-to-run noise.
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

from report import optimizer_rows, table

ROOT = Path(__file__).resolve().parents[1]
TEST_FILES = ("tests/test_cuda.py", "tests/test_cuda_ranks.py")
# Sizes per machine. GPU: the figures of the project's GPU issues (H100, one rank). A tiny
# model learns faster: a higher --parity-lr.
TINY = "--dim 64 --depth 2 --seq 32 --batch 2 --heads 4 --vocab 128 --steps 2 --rounds 1 " \
       "--warmup 0 --parity-steps 8 --parity-lr 1e-3"
LLAMA = {"gpu": "--dim 2048 --depth 16 --seq 2048 --batch 4 --heads 16 --vocab 32768",
         "cpu": TINY}
GPT = {"gpu": "--dim 1024 --depth 16 --seq 1024 --batch 8 --heads 16 --vocab 32768",
       "cpu": TINY}
OPTIMIZER = {"gpu": "--rounds 9 --calls 5", "cpu": "--dims 64 --rounds 1 --calls 1"}
PEAK_TFLOPS = {"H100": 989, "H200": 989}  # dense bf16, for MFU
TESTS_TIMEOUT, STEP_TIMEOUT = 300, 360  # seconds


def run(command: list[str], log: Path, timeout: float, **options: object) -> tuple[int, str]:
    """`command` run from the repository's root: its exit code (-1: timed out), its output
    (also in `log`)."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, **options)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = -1, f"timed out after {timeout:.0f} s\n{expired.stdout or ''}"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(output)
    return code, output


def run_tests(out: Path, machine: str, timeout: float) -> dict:
    """Both GPU test files in one pytest run; each test's outcome from the JUnit report:
    `file::test[params]`: passed, failed, error or skipped (with pytest's reason)."""
    start, junit = time.perf_counter(), out / "tests.xml"
    env = {**os.environ, **({"FSDP_COMPOSE_TEST_DEVICE": "cpu"} if machine == "cpu" else {})}
    code, _ = run([sys.executable, "-m", "pytest", *TEST_FILES, "-q", f"--junitxml={junit}"],
                  out / "tests.log", timeout, env=env)
    outcomes = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase") if junit.exists() else []:
        tags = {child.tag: child.get("message", "") for child in case}
        outcomes[f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"] = (
            "failed" if "failure" in tags else "error" if "error" in tags
            else f"skipped: {tags['skipped']}" if "skipped" in tags else "passed")
    return {"seconds": time.perf_counter() - start, "exit_code": code, "outcomes": outcomes}


def run_benchmark(command: list[str], folder: Path, result: str, timeout: float) -> dict:
    """One benchmark writing `result` into `folder`; its JSON, or why there is none."""
    start = time.perf_counter()
    code, log = run([sys.executable, *command, "--out", str(folder)], folder / "log.txt", timeout)
    if code != 0 or not (folder / result).exists():
        return {"seconds": time.perf_counter() - start, "error": log[-3000:]}
    return {"seconds": time.perf_counter() - start,
            "result": json.loads((folder / result).read_text())}


def step_summary(run: dict) -> dict:
    """Per contender what the summary shows, and ours against FSDP2 beside FSDP2 against
    itself."""
    if "error" in run:
        return {"ok": False, **run}
    result = run["result"]
    copies, model_bytes = result["copies"], result["copies"]["model"]["total_bytes"]
    contenders = {name: {
        "step_ms": step * 1e3, "host_ms": result["host_seconds"][name] * 1e3,
        "vs_fsdp2": result["vs_fsdp2"][name], "mfu": (result.get("mfu") or {}).get(name),
        "allocator_step_peak_mib":
            result["peak_memory"][name].get("allocator step peak", 0) / 2**20 or None,
        "tracked_peak_mib": result["peak_memory"][name]["Total"] / 2**20,
        "copied_beyond_model_mib": (copies[name]["total_bytes"] - model_bytes) / 2**20,
    } for name, step in result["step_seconds"].items()}
    parity = result["loss_parity"]
    ours, noise = (parity["max_difference_vs_fsdp2"][n] for n in ("fsdp_compose", "FSDP2 again"))
    verdict = {"ours_vs_fsdp2": ours, "fsdp2_vs_fsdp2": noise, "within_noise": ours <= 2 * noise,
               "loss_falls": parity["loss_falls"], "ok": ours <= 2 * noise and parity["loss_falls"]}
    return {"ok": verdict["ok"], "seconds": run["seconds"], "contenders": contenders,
            "loss_parity": verdict, "losses": parity["losses"],
            "device": result["config"]["device"]}


def markdown(summary: dict) -> str:
    tests, optimizer = summary["tests"], summary["optimizer"]
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
        lines.append(table(
            ["contender", "step ms", "host ms", "vs FSDP2", "MFU", "allocator step peak MiB",
             "tracked peak MiB", "copied beyond model MiB"], "llllllll",
            [[who, f"{row['step_ms']:.1f}", f"{row['host_ms']:.1f}", f"{row['vs_fsdp2']:.2f}",
              *("-" if row[key] is None else f"{row[key]:{form}}" for key, form in
                (("mfu", ".3f"), ("allocator_step_peak_mib", ".0f"))),
              f"{row['tracked_peak_mib']:.0f}", f"{row['copied_beyond_model_mib']:.1f}"]
             for who, row in bench["contenders"].items()]))
        parity, losses = bench["loss_parity"], bench["losses"]["FSDP2"]
        lines += ["", f"Loss parity, deterministic: FSDP2's loss {losses[0]:.4f} -> "
                  f"{losses[-1]:.4f}; max |loss - FSDP2's|: fsdp_compose "
                  f"{parity['ours_vs_fsdp2']:.3g}, FSDP2 again {parity['fsdp2_vs_fsdp2']:.3g} "
                  f"({'within' if parity['within_noise'] else 'ABOVE'} FSDP2's own noise)."]
    lines += ["", "## AdamW's step alone (benchmarks/optimizer.py)", ""]
    lines += ["```", optimizer["error"], "```"] if "error" in optimizer else [table(
        ["dim, policy, AdamW", "fsdp_compose ms", "FSDP2 ms", "plain ms", "ours / plain",
         "FSDP2 / plain"], "llllll",
        [[name, *(f"{row[k]:.2f}" for k in ("fsdp_compose", "FSDP2", "plain", "ours_vs_plain",
                                            "fsdp2_vs_plain"))]
         for name, row in optimizer["rows"].items()])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="the same sequence, tiny, on the CPU")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak (default: by its name)")
    args = parser.parse_args(argv)
    import torch  # after the arguments: --help needs no torch

    machine = "cpu" if args.cpu else "gpu"
    if machine == "gpu" and not torch.cuda.is_available():
        parser.error("no GPU here: pass --cpu for the dry run")
    peak = args.peak_tflops if args.peak_tflops is not None or args.cpu else next(
        (v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name(0)), None)
    args.out.mkdir(parents=True, exist_ok=True)
    tests = run_tests(args.out, machine, TESTS_TIMEOUT)
    print(f"tests: {tests['exit_code']=} in {tests['seconds']:.0f} s", flush=True)
    peak = [] if peak is None else ["--peak-tflops", str(peak)]
    llama = ["--model", "llama", *LLAMA[machine].split(), "--mixed-precision", *peak]
    steps = {}
    for name, step_args in {
            "llama eager": llama,
            "llama compiled": [*llama, "--compile"] + ["--compile-backend", "aot_eager"] * args.cpu,
            "gpt bf16": ["--model", "gpt", *GPT[machine].split(), "--dtype", "bfloat16", *peak],
    }.items():
        steps[name] = run_benchmark(
            ["-m", "torch.distributed.run", "--nproc_per_node=1", "benchmarks/step.py",
             *step_args], args.out / name.replace(" ", "_"), "step.json", STEP_TIMEOUT)
        print(f"{name}: {'ok' if 'result' in steps[name] else 'FAILED'} in "
              f"{steps[name]['seconds']:.0f} s", flush=True)
    optimizer = run_benchmark(["benchmarks/optimizer.py", *OPTIMIZER[machine].split()],
                              args.out / "optimizer", "optimizer.json", STEP_TIMEOUT)
    optimizer = {"ok": False, **optimizer} if "error" in optimizer else {
        "ok": True, "seconds": optimizer["seconds"], "rows": {
            f"{dim}, {policy}, {variant}": {**ms, "ours_vs_plain": ms["fsdp_compose"] / ms["plain"],
                                            "fsdp2_vs_plain": ms["FSDP2"] / ms["plain"]}
            for dim, policy, variant, ms in optimizer_rows(optimizer["result"])}}
    print(f"optimizer: {'ok' if optimizer['ok'] else 'FAILED'}", flush=True)
    failed = [n for n, o in tests["outcomes"].items() if o in ("failed", "error")]
    tests_ok = bool(tests["outcomes"]) and not failed and tests["exit_code"] in (0, 5)
    benches = {name: step_summary(run) for name, run in steps.items()}
    summary = {"machine": machine, "tests": {**tests, "failed": failed, "ok": tests_ok},
               "benchmarks": benches, "optimizer": optimizer,
               "ok": tests_ok and all(b["ok"] for b in benches.values()) and optimizer["ok"]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
