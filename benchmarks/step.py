"""Training step time, host time, peak memory, communication and copies: fsdp_compose,
torch's fully_shard (FSDP2), DDP and a single-process floor, side by side in one run.

    torchrun --nproc_per_node=2 benchmarks/step.py                  # CPU, gloo: a few minutes
    torchrun --nproc_per_node=8 benchmarks/step.py --model llama --dim 1024 --depth 16 \
        --seq 1024 --heads 16 --vocab 32768 --mixed-precision --compile --peak-tflops 989

Every contender trains the same model (--model: the GPT of examples/train_gpt.py or the
Llama of benchmarks/llama.py; one unit per block plus the root) from the same weights on
the same batches with AdamW (fused on CUDA). --compile compiles each block in place before
sharding or wrapping, as torchtitan does. --mixed-precision gives both FSDPs
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) and runs DDP and the
floor under bfloat16 autocast. The floor is the plain model on each rank's batch without
communication, all ranks at once (the same contention for the machine).

Rounds interleave the contenders so that drift hits all alike: the step time is the
median over rounds, the host time (from a step's start until Python has issued it, before
any synchronize; the step time, near enough, on CPU) the median over steps. Then one step
each is counted at dispatch: collectives and their bytes against the floor of one
all-gather per unit and pass and one reduce-scatter per unit, and bytes copied outside
collectives, by op, against the FSDP floor (step_counting.copy_floor: nothing but the
casts of mixed precision) beyond the model's own copies. Peak memory per rank comes from
one more step (torch's MemTracker, by category) against the analytic bound (step_counting.
analytic). The counted steps run eagerly even under --compile: dynamo skips frames while a
dispatch mode is active. On CUDA it also reports MFU and the fraction of communication
hidden under compute (step_gpu.py). Rank 0 prints a table and writes JSON (with the
machine, versions and date: benchmarks/report.py turns it into docs/performance.md) and a
PNG chart (with matplotlib) to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from llama import Llama
from step_counting import CollectiveCounter, CopyCounter, analytic, ddp_bytes
from step_gpu import hidden_communication, mfu
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from provenance import provenance  # noqa: E402
from train_gpt import GPT, counting_batch, init_distributed  # noqa: E402

from fsdp_compose import MixedPrecisionPolicy, fully_shard  # noqa: E402

# cuBLAS picks its algorithms deterministically with this, read at its first use: the loss
# parity runs (loss_parity) can then be compared bit for bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

CONTENDERS = ("fsdp_compose", "FSDP2", "DDP", "floor")
# The loss parity runs: FSDP2 twice, for the run-to-run noise ours is read against.
PARITY_RUNS = ("fsdp_compose", "FSDP2", "FSDP2 again")
SHARDED = ("fsdp_compose", "FSDP2")
MODELS = {"gpt": GPT, "llama": Llama}


def make_model(args: argparse.Namespace) -> nn.Module:
    return MODELS[args.model](args.vocab, args.dim, args.heads, args.depth, args.seq)


def build(name: str, args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same weights for every contender
    model = make_model(args).to(device, args.dtype)
    if args.compile:
        for block in model.blocks:
            # In place, so that names, hooks and the blocks list stay as they were.
            block.compile(backend=args.compile_backend)
    if name in SHARDED:
        shard = fully_shard if name == "fsdp_compose" else torch_fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = mp_policy(name, args)
        for block in model.blocks:
            shard(block, mesh=mesh, mp_policy=policy)
        shard(model, mesh=mesh, mp_policy=policy)
    elif name == "DDP":
        model = DistributedDataParallel(model, device_ids=[device.index] if device.index is not None else None)
    return model


def mp_policy(name: str, args: argparse.Namespace) -> MixedPrecisionPolicy | TorchMixedPrecisionPolicy:
    policy = MixedPrecisionPolicy if name == "fsdp_compose" else TorchMixedPrecisionPolicy
    if not args.mixed_precision:
        return policy()
    return policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def autocast_dtype(name: str, args: argparse.Namespace) -> torch.dtype | None:
    """Under --mixed-precision the FSDPs cast in their gathers; DDP and the floor keep
    their float32 parameters and compute under autocast instead."""
    return torch.bfloat16 if args.mixed_precision and name not in SHARDED else None


class Contender(NamedTuple):
    model: nn.Module
    optim: torch.optim.Optimizer
    autocast: torch.dtype | None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return train_step(self.model, self.optim, tokens, self.autocast)


def contender(name: str, args: argparse.Namespace, device: torch.device, lr: float | None = None) -> Contender:
    model = build(name, args, device)
    # fused=None, not False, off CUDA: False would also turn off the foreach default.
    fused = True if device.type == "cuda" else None
    optim = torch.optim.AdamW(model.parameters(), lr=lr or args.lr, fused=fused)
    return Contender(model, optim, autocast_dtype(name, args))


def batch(args: argparse.Namespace, step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step * dist.get_world_size() + dist.get_rank())
    return counting_batch(args.batch, args.seq, args.vocab, generator).to(device)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor,
               autocast: torch.dtype | None = None) -> torch.Tensor:
    with torch.autocast(tokens.device.type, dtype=autocast, enabled=autocast is not None):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor,
                   autocast: torch.dtype | None = None) -> dict[str, int]:
    """MemTracker's peak by category; on CUDA also the allocator's peak during the step
    above what was allocated at its start ("allocator step peak": every contender's model
    lives on the device, so the absolute peak would mix them)."""
    cuda = tokens.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(tokens.device)
        torch.cuda.reset_peak_memory_stats(tokens.device)
        resident = torch.cuda.memory_allocated(tokens.device)
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        train_step(model, optim, tokens, autocast)
    peak = tracker.get_tracker_snapshot("peak")
    by_category = next(iter(peak.values()))
    if cuda:
        by_category["allocator step peak"] = torch.cuda.max_memory_allocated(tokens.device) - resident
    return {getattr(k, "value", k): int(v) for k, v in by_category.items()}


class Timings(NamedTuple):
    step: dict[str, list[float]]  # seconds per step, averaged over each round's steps
    host: dict[str, list[float]]  # seconds to issue each step, per step
    losses: dict[str, list[float]]
    steps: int  # batches used, so that later steps take new ones


def timed_rounds(args: argparse.Namespace, contenders: dict[str, Contender], device: torch.device) -> Timings:
    timings = Timings(*({name: [] for name in CONTENDERS} for _ in range(3)), steps=0)
    for round_ in range(args.warmup + args.rounds):
        timed = round_ >= args.warmup
        for name, c in contenders.items():  # interleaved: drift hits every contender alike
            start = time.perf_counter()
            for k in range(args.steps):
                tokens = batch(args, timings.steps + k, device)
                issued = time.perf_counter()
                loss = c.step(tokens)
                if timed:  # on CUDA the kernels may still run: this is the host's share
                    timings.host[name].append(time.perf_counter() - issued)
                if name != "floor":
                    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                    timings.losses[name].append(loss.item() / dist.get_world_size())
            synchronize(device)
            if timed:
                timings.step[name].append((time.perf_counter() - start) / args.steps)
        timings = timings._replace(steps=timings.steps + args.steps)
    return timings


def loss_parity(args: argparse.Namespace, device: torch.device) -> dict:
    """The losses of --parity-steps steps at --parity-lr (where the model trains: its loss
    falls) of fsdp_compose, FSDP2 and FSDP2 again, one after another from the same weights
    on the same batches, with deterministic algorithms where torch has them and one
    attention backend. FSDP2 against itself is the run-to-run noise floor; ours against
    FSDP2 is read against it (0.0 and 0.0 on the CPU). Eager even under --compile: three
    more compilations would cost minutes, and the compiled step's numbers are the timed
    rounds' business."""
    args = argparse.Namespace(**{**vars(args), "compile": False})
    losses: dict[str, list[float]] = {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn where torch has none
    try:
        for run_name in PARITY_RUNS:
            c = contender(run_name.removesuffix(" again"), args, device, lr=args.parity_lr)
            losses[run_name] = []
            with sdpa_kernel(attention_backends(device)):
                for step in range(args.parity_steps):
                    loss = c.step(batch(args, step, device))
                    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                    losses[run_name].append(loss.item() / dist.get_world_size())
            del c
            release_memory(device)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    reference = losses["FSDP2"]
    return {
        "steps": args.parity_steps, "lr": args.parity_lr, "losses": losses,
        "max_difference_vs_fsdp2": {
            n: max((abs(a - b) for a, b in zip(losses[n], reference)), default=0.0)
            for n in ("fsdp_compose", "FSDP2 again")
        },
        "loss_falls": bool(reference) and reference[-1] < reference[0],
    }


def attention_backends(device: torch.device) -> list[SDPBackend]:
    """One attention kernel for every run: flash on CUDA where the dtype allows it (its
    backward is deterministic under torch's deterministic mode), the math one otherwise."""
    if device.type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.MATH]


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def counted_step(name: str, c: Contender, tokens: torch.Tensor) -> tuple[dict, dict]:
    """One step's collectives (DDP's from its parameters: it all-reduces from C++) and
    copies outside them."""
    with CollectiveCounter() as sent, CopyCounter(c.model) as copied:
        c.step(tokens)
    if name == "DDP":
        return {"calls": {}, "bytes": ddp_bytes(c.model)}, copied.result()
    return {"calls": sent.calls, "bytes": sent.bytes}, copied.result()


def model_copies(args: argparse.Namespace, device: torch.device, tokens: torch.Tensor) -> dict:
    """The copies the model makes itself, computing in the FSDPs' dtype (a bfloat16 RMSNorm
    computes in float32, the loss copies its targets): each contender's count includes
    them, and what it copies beyond them is the cost of its runtime or of autocast."""
    plain = build("floor", args, device).to(torch.bfloat16 if args.mixed_precision else args.dtype)
    with CopyCounter(plain) as copied:
        train_step(plain, torch.optim.SGD(plain.parameters()), tokens)
    return copied.result()


def run(args: argparse.Namespace, device: torch.device) -> dict:
    contenders = {name: contender(name, args, device) for name in CONTENDERS}
    timings = timed_rounds(args, contenders, device)
    tokens = batch(args, timings.steps, device)
    comm, copies = {}, {}
    for name, c in contenders.items():
        comm[name], copies[name] = counted_step(name, c, tokens)
    copies["model"] = model_copies(args, device, tokens)
    memory = {name: measure_memory(c.model, c.optim, tokens, c.autocast) for name, c in contenders.items()}
    floor = analytic(args, contenders["floor"].model, memory["floor"])
    median = {name: statistics.median(t) for name, t in timings.step.items()}
    utilisation, hidden = gpu_measures(args, contenders, median, tokens)
    del contenders  # the parity runs build their own, one at a time
    release_memory(device)
    parity = loss_parity(args, device)
    reference = timings.losses["FSDP2"]
    return {
        "config": {**vars(args), "world_size": dist.get_world_size(), "device": str(device),
                   "backend": dist.get_backend(), **provenance(device)},
        "step_seconds": median,
        "host_seconds": {name: statistics.median(t) for name, t in timings.host.items()},
        "vs_fsdp2": {n: median[n] / median["FSDP2"] for n in CONTENDERS},
        "vs_floor": {n: median[n] / median["floor"] for n in CONTENDERS},
        "peak_memory": memory,
        "analytic": floor,
        "communication": {n: comm[n] for n in ("fsdp_compose", "FSDP2", "DDP")},
        "copies": copies,  # by contender, and the model's own
        "max_loss_difference_vs_fsdp2": {
            n: max(abs(a - b) for a, b in zip(timings.losses[n], reference)) for n in ("fsdp_compose", "DDP")
        },
        "losses": {n: timings.losses[n] for n in ("fsdp_compose", "FSDP2", "DDP")},
        "loss_parity": parity,
        "mfu": utilisation,
        "hidden_communication": hidden,
    }


def gpu_measures(args: argparse.Namespace, contenders: dict[str, Contender], median: dict[str, float],
                 tokens: torch.Tensor) -> tuple[dict | None, dict | None]:
    """MFU (with --peak-tflops) and the communication hidden under compute, on CUDA."""
    if tokens.device.type != "cuda":
        return None, None
    hidden = {n: hidden_communication(partial(contenders[n].step, tokens)) for n in CONTENDERS[:3]}
    if args.peak_tflops is None:
        return None, hidden
    with torch.device("meta"):
        params = sum(p.numel() for p in make_model(args).parameters())
    return mfu(args, params, median), hidden


def report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "step.json").write_text(json.dumps(result, indent=1, default=str))
    memory, bound = result["peak_memory"], result["analytic"]["memory_bound"]
    copies = result["copies"]
    print(f"{'':14}{'step ms':>9}{'host ms':>9}{'vs FSDP2':>10}{'vs floor':>10}{'peak KiB':>10}"
          f"{'vs bound':>10}{'copied KiB':>12}{'beyond model':>14}")
    for name in CONTENDERS:
        peak, copied = memory[name]["Total"], copies[name]["total_bytes"]
        print(f"{name:14}{result['step_seconds'][name] * 1e3:9.1f}{result['host_seconds'][name] * 1e3:9.1f}"
              f"{result['vs_fsdp2'][name]:10.2f}{result['vs_floor'][name]:10.2f}{peak / 1024:10.0f}"
              f"{peak / bound:10.2f}{copied / 1024:12.1f}{(copied - copies['model']['total_bytes']) / 1024:14.1f}")
    print(f"memory bound per rank: {bound / 1024:.0f} KiB")
    for name, comm in result["communication"].items():
        print(f"{name:14}collectives {comm['calls'] or '-'}  bytes {comm['bytes']}")
    a = result["analytic"]
    print(f"{'floor':14}all_gather {a['all_gather_calls']} x, {a['all_gather_bytes']} B; "
          f"reduce_scatter {a['reduce_scatter_calls']} x, {a['reduce_scatter_bytes']} B")
    print("bytes copied outside collectives per step and rank, by op (model: the model's own):")
    for name, counted in copies.items():
        print(f"{name:14}{counted['bytes'] or '-'}  total {counted['total_bytes']} B")
    print(f"{'FSDP floor':14}beyond the model's own: gathers {a['copy_gather_bytes']} B, param_dtype "
          f"casts {a['copy_param_cast_bytes']} B, reduce_dtype casts {a['copy_grad_cast_bytes']} B, "
          f"total {a['copy_bytes']} B; with one reduce-scatter per unit "
          f"{a['copy_one_reduce_scatter_bytes']} B")
    print(f"max |loss - FSDP2's| over the timed steps: {result['max_loss_difference_vs_fsdp2']}")
    parity = result["loss_parity"]
    first, last = parity["losses"]["FSDP2"][0], parity["losses"]["FSDP2"][-1]
    print(f"loss parity, {parity['steps']} deterministic steps at lr {parity['lr']} (FSDP2's loss "
          f"{first:.4f} -> {last:.4f}): max |loss - FSDP2's| " + ", ".join(
              f"{n} {v:.3g}" for n, v in parity["max_difference_vs_fsdp2"].items()))
    for key in ("mfu", "hidden_communication"):
        if result[key] is not None:
            print(f"{key}: " + ", ".join(f"{n} {v:.3f}" for n, v in result[key].items()))
    from report import plot_step  # the chart of docs/performance.md

    if not plot_step(result, out / "step.png"):
        print("matplotlib not installed: no chart (pip install matplotlib)")
        return
    print(f"wrote {out / 'step.json'} and {out / 'step.png'}")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its sizes, its batch and its training (what build, batch and train_step
    read)."""
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--parity-steps", type=int, default=8,
                        help="steps of the deterministic loss comparison (loss_parity)")
    parser.add_argument("--parity-lr", type=float, default=3e-4,
                        help="its learning rate: one at which the model trains")
    parser.add_argument("--dtype", type=lambda name: getattr(torch, name), default=torch.float32,
                        help="of the whole model and its training, e.g. bfloat16 on GPUs")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="bfloat16 compute, float32 parameters and reductions (FSDP's "
                             "MixedPrecisionPolicy; autocast for DDP and the floor)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--compile-backend", default="inductor",
                        help="e.g. aot_eager: traced like inductor, without generating code")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1, help="rounds not timed")
    parser.add_argument("--peak-tflops", type=float, help="GPU peak, for MFU")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if args.mixed_precision and args.dtype != torch.float32:
        parser.error("--mixed-precision keeps float32 parameters: leave --dtype at float32")
    start = time.perf_counter()
    result = run(args, init_distributed())
    result["config"]["wall_seconds"] = time.perf_counter() - start
    if dist.get_rank() == 0:
        report(result, args.out)
    gc.collect()  # meshes go before the process group (see examples/train_gpt.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
