"""Training step time, host time, peak memory, communication and copies: fsdp_compose,
torch's fully_shard (FSDP2), DDP and a single-process floor, side by side in one run.

    torchrun --nproc_per_node=2 benchmarks/step.py   # CPU, gloo (CONTRIBUTING.md: on GPUs)

Every contender trains the same model (--model: the GPT of examples/train_gpt.py or the Llama
of benchmarks/models.py; one unit per block plus the root) from the same weights on the same
batches with AdamW (fused on CUDA). --compile compiles each block in place before sharding or
wrapping, as torchtitan does. --mixed-precision gives both FSDPs bfloat16 parameters and
float32 reductions, and runs DDP and the floor under bfloat16 autocast. The floor is the plain
model on each rank's batch without communication, all ranks at once (the same contention).

Rounds interleave the contenders: the step time is the median over rounds, the host time (until
Python has issued a step, before any synchronize) the median over steps. Then one step each is
counted at dispatch and one more tracks peak memory (measures.py), and on CUDA the profiler
tells how much communication compute hides. Rank 0 prints the tables of docs/performance.md
and writes step.json (benchmarks/report.py reads it) and a chart to --out.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from functools import partial
from typing import NamedTuple

import harness
import report
import torch
import torch.distributed as dist
import torch.nn.functional as F
from measures import CollectiveCounter, CopyCounter, analytic, ddp_bytes, hidden_communication, mfu
from models import Llama
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel
from train_gpt import GPT, counting_batch, init_distributed

# cuBLAS picks its algorithms deterministically with this, read at its first use: the loss
# parity runs (loss_parity) can then be compared bit for bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

CONTENDERS = ("fsdp_compose", "FSDP2", "DDP", "floor")
SHARDED = ("fsdp_compose", "FSDP2")
# The loss parity runs: FSDP2 twice, for the run-to-run noise ours is read against.
PARITY_RUNS = ("fsdp_compose", "FSDP2", "FSDP2 again")
MODELS = {"gpt": GPT, "llama": Llama}
LR = 3e-3


def make_model(args: argparse.Namespace) -> nn.Module:
    return MODELS[args.model](args.vocab, args.dim, args.heads, args.depth, args.seq)


def build(name: str, args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same weights for every contender
    model = make_model(args).to(device, args.dtype)
    if args.compile:
        for block in model.blocks:  # in place: names, hooks and the blocks list stay
            block.compile(backend=args.compile_backend)
    if name == "DDP":
        return DistributedDataParallel(model, device_ids=None if device.index is None
                                       else [device.index])
    if name in SHARDED:
        dtypes = (torch.bfloat16, torch.float32) if args.mixed_precision else ()
        harness.shard(model, model.blocks, name, mp_policy=harness.policy(name, *dtypes),
                      mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    return model


class Contender(NamedTuple):
    model: nn.Module
    optim: torch.optim.Optimizer
    autocast: torch.dtype | None  # DDP's and the floor's under --mixed-precision

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return train_step(self.model, self.optim, tokens, self.autocast)


def contender(name: str, args: argparse.Namespace, device: torch.device, lr: float = LR,
              ) -> Contender:
    model = build(name, args, device)
    # fused=None, not False, off CUDA: False would also turn off the foreach default.
    optim = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda" or None)
    autocast = torch.bfloat16 if args.mixed_precision and name not in SHARDED else None
    return Contender(model, optim, autocast)


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
    by_category = next(iter(tracker.get_tracker_snapshot("peak").values()))
    if cuda:
        by_category["allocator step peak"] = \
            torch.cuda.max_memory_allocated(tokens.device) - resident
    return {getattr(k, "value", k): int(v) for k, v in by_category.items()}


class Timings(NamedTuple):
    step: dict[str, list[float]]  # seconds per step, averaged over each round's steps
    host: dict[str, list[float]]  # seconds to issue each step, per step
    losses: dict[str, list[float]]
    steps: int  # batches used, so that later steps take new ones


def timed_rounds(args: argparse.Namespace, contenders: dict[str, Contender],
                 device: torch.device) -> Timings:
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
                    timings.losses[name].append(mean_loss(loss))
            synchronize(device)
            if timed:
                timings.step[name].append((time.perf_counter() - start) / args.steps)
        timings = timings._replace(steps=timings.steps + args.steps)
    return timings


def mean_loss(loss: torch.Tensor) -> float:
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    return loss.item() / dist.get_world_size()


def loss_parity(args: argparse.Namespace, device: torch.device) -> dict:
    """The losses of --parity-steps steps at --parity-lr (where the model trains: its loss
    falls) of fsdp_compose, FSDP2 and FSDP2 again, one after another from the same weights
    on the same batches, with deterministic algorithms where torch has them and one
    attention kernel (flash on CUDA, whose backward is deterministic there; else the math
    one). FSDP2 against itself is the run-to-run noise floor ours is read against. Eager
    even under --compile: three more compilations would cost minutes."""
    args = argparse.Namespace(**{**vars(args), "compile": False})
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if device.type == "cuda" \
        else [SDPBackend.MATH]
    losses: dict[str, list[float]] = {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn where torch has none
    try:
        for run_name in PARITY_RUNS:
            c = contender(run_name.removesuffix(" again"), args, device, lr=args.parity_lr)
            with sdpa_kernel(kernels):
                losses[run_name] = [mean_loss(c.step(batch(args, step, device)))
                                    for step in range(args.parity_steps)]
            del c
            release_memory(device)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    reference = losses["FSDP2"]
    return {
        "steps": args.parity_steps, "lr": args.parity_lr, "losses": losses,
        "max_difference_vs_fsdp2": {
            n: max((abs(a - b) for a, b in zip(losses[n], reference)), default=0.0)
            for n in ("fsdp_compose", "FSDP2 again")},
        "loss_falls": bool(reference) and reference[-1] < reference[0],
    }


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
    memory = {name: measure_memory(c.model, c.optim, tokens, c.autocast)
              for name, c in contenders.items()}
    median = {name: statistics.median(t) for name, t in timings.step.items()}
    utilisation, hidden = gpu_measures(args, contenders, median, tokens)
    floor = analytic(args, contenders["floor"].model, memory["floor"])
    del contenders  # the parity runs build their own, one at a time
    release_memory(device)
    losses = timings.losses
    return {
        "config": harness.config(args, device, world_size=dist.get_world_size(),
                                 device=str(device), backend=dist.get_backend()),
        "step_seconds": median,
        "host_seconds": {name: statistics.median(t) for name, t in timings.host.items()},
        "vs_fsdp2": {n: median[n] / median["FSDP2"] for n in CONTENDERS},
        "vs_floor": {n: median[n] / median["floor"] for n in CONTENDERS},
        "peak_memory": memory,
        "analytic": floor,
        "communication": {n: comm[n] for n in ("fsdp_compose", "FSDP2", "DDP")},
        "copies": copies,  # by contender, and the model's own
        "max_loss_difference_vs_fsdp2": {
            n: max(abs(a - b) for a, b in zip(losses[n], losses["FSDP2"]))
            for n in ("fsdp_compose", "DDP")},
        "losses": {n: losses[n] for n in ("fsdp_compose", "FSDP2", "DDP")},
        "loss_parity": loss_parity(args, device),
        "mfu": utilisation,
        "hidden_communication": hidden,
    }


def gpu_measures(args: argparse.Namespace, contenders: dict[str, Contender],
                 median: dict[str, float], tokens: torch.Tensor,
                 ) -> tuple[dict | None, dict | None]:
    """MFU (with --peak-tflops) and the communication hidden under compute, on CUDA."""
    if tokens.device.type != "cuda":
        return None, None
    hidden = {n: hidden_communication(partial(contenders[n].step, tokens))
              for n in CONTENDERS[:3]}
    if args.peak_tflops is None:
        return None, hidden
    with torch.device("meta"):
        params = sum(p.numel() for p in make_model(args).parameters())
    return mfu(args, params, median), hidden


def show(result: dict) -> None:
    """The tables docs/performance.md shows, and the loss comparisons."""
    print(report.step_table(result), report.bytes_table(result), report.copies_table(result),
          sep="\n\n")
    parity = result["loss_parity"]
    first, last = parity["losses"]["FSDP2"][0], parity["losses"]["FSDP2"][-1]
    print(f"max |loss - FSDP2's| over the timed steps: {result['max_loss_difference_vs_fsdp2']}; "
          f"in {parity['steps']} deterministic steps at lr {parity['lr']} (FSDP2's loss "
          f"{first:.4f} -> {last:.4f}): " + ", ".join(
              f"{n} {v:.3g}" for n, v in parity["max_difference_vs_fsdp2"].items()))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its sizes, its batch and its training (what build, batch and train_step
    read)."""
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    for name, default in (("seq", 64), ("vocab", 256), ("dim", 128), ("heads", 4), ("depth", 8)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", type=lambda name: getattr(torch, name), default=torch.float32,
                        help="of the whole model and its training, e.g. bfloat16 on GPUs")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="bfloat16 compute, float32 parameters and reductions (FSDP's "
                             "MixedPrecisionPolicy; autocast for DDP and the floor)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--compile-backend", default="inductor",
                        help="e.g. aot_eager: traced like inductor, without generating code")


def main() -> None:
    parser = harness.parser(__doc__)
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1, help="rounds not timed")
    parser.add_argument("--parity-steps", type=int, default=8,
                        help="steps of the deterministic loss comparison (loss_parity)")
    parser.add_argument("--parity-lr", type=float, default=3e-4,
                        help="its learning rate: one at which the model trains")
    parser.add_argument("--peak-tflops", type=float, help="GPU peak, for MFU")
    args = parser.parse_args()
    if args.mixed_precision and args.dtype != torch.float32:
        parser.error("--mixed-precision keeps float32 parameters: leave --dtype at float32")
    started = time.perf_counter()
    device = init_distributed()
    result = run(args, device)
    if dist.get_rank() == 0:
        harness.write(args.out, "step", result, started)
        show(result)
        if report.plot_step(result, args.out / "step.png"):
            print(f"wrote {args.out / 'step.png'}")
    gc.collect()  # meshes go before the process group (see examples/train_gpt.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
