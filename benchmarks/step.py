"""Training step time, peak memory and communication: fsdp_compose, torch's fully_shard
(FSDP2), DDP and a single-process floor, side by side in one run.

    torchrun --nproc_per_node=2 benchmarks/step.py                  # CPU, gloo: a few minutes
    torchrun --nproc_per_node=8 benchmarks/step.py --dim 1024 --depth 16 --seq 1024 \
        --heads 16 --vocab 32768 --dtype bfloat16 --peak-tflops 989   # GPUs (H100: 989)

Every contender trains the GPT of examples/train_gpt.py (one unit per block plus the root)
from the same weights on the same batches with AdamW. Rounds interleave the contenders so
that machine drift hits all alike; the step time is the median over rounds. The floor is
the plain model on each rank's batch without communication, all ranks at once (the same
contention for the machine). Peak memory per rank comes from a separate tracked step
(torch's MemTracker, by category) next to the analytic bound: sharded parameters,
gradients and AdamW state, plus the largest units unsharded at once (one computing, one
prefetched, and the gradient of the one computing), plus the floor's activations and
temporaries at its peak. Collectives and bytes per step are counted at dispatch, next to
the analytic floor of one all-gather per unit per pass and one reduce-scatter per unit.
On CUDA it also reports MFU and, from the profiler, the fraction of communication hidden
under compute. Rank 0 prints a table and writes JSON (with the machine, versions and
date: benchmarks/report.py turns it into docs/performance.md) and a PNG chart (with
matplotlib) to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from overlap import hidden_fraction  # noqa: E402
from provenance import provenance  # noqa: E402
from train_gpt import GPT, counting_batch, init_distributed  # noqa: E402

from fsdp_compose import fully_shard  # noqa: E402

CONTENDERS = ("fsdp_compose", "FSDP2", "DDP", "floor")
COLLECTIVES = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
}


def build(name: str, args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same weights for every contender
    model = GPT(args.vocab, args.dim, args.heads, args.depth, args.seq).to(device, args.dtype)
    if name in ("fsdp_compose", "FSDP2"):
        shard = fully_shard if name == "fsdp_compose" else torch_fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
    elif name == "DDP":
        model = DistributedDataParallel(model, device_ids=[device.index] if device.index is not None else None)
    return model


def batch(args: argparse.Namespace, step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step * dist.get_world_size() + dist.get_rank())
    return counting_batch(args.batch, args.seq, args.vocab, generator).to(device)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CollectiveCounter(TorchDispatchMode):
    """Collectives issued from Python, with their payload (output of an all-gather, input
    of a reduce-scatter, the tensor of an all-reduce) in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = COLLECTIVES.get(func._schema.name)
        if kind is not None:
            payload = args[1] if kind == "reduce_scatter" else args[0]
            tensors = payload if isinstance(payload, (list, tuple)) else [payload]
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def ddp_bytes(model: nn.Module) -> dict[str, int]:
    """DDP all-reduces every gradient once per step from C++ (not seen at dispatch)."""
    return {"all_reduce": sum(p.numel() * p.element_size() for p in model.parameters())}


def analytic(args: argparse.Namespace, plain: nn.Module, floor_peak: dict[str, int]) -> dict[str, float]:
    """The floors: bytes each collective must carry, and the paper's memory bound, whose
    working memory (activations and temporaries) is the floor's at its peak (`floor_peak`,
    measure_memory's categories)."""
    world = dist.get_world_size()
    working = floor_peak["Activation"] + floor_peak["Temp"]

    def padded(params: list[nn.Parameter]) -> int:  # each parameter padded to W shards on dim 0
        return sum(-(-p.shape[0] // world) * world * p[0].numel() * p.element_size() for p in params)

    blocks = [padded(list(b.parameters())) for b in plain.blocks]
    root = padded([p for n, p in plain.named_parameters() if not n.startswith("blocks.")])
    params = sum(p.numel() * p.element_size() for p in plain.parameters())
    shards = padded(list(plain.parameters())) // world  # per rank, padding included
    largest = max(blocks)
    return {
        # Blocks are gathered in forward and again in backward; the root stays unsharded.
        "all_gather_bytes": 2 * sum(blocks) + root,
        "reduce_scatter_bytes": sum(blocks) + root,
        "all_gather_calls": 2 * len(blocks) + 1,
        "reduce_scatter_calls": len(blocks) + 1,
        "ddp_all_reduce_bytes": params,
        # Sharded params + grads + 2 AdamW moments, the root (unsharded throughout) and the
        # largest block computing with its gradient and the next prefetched, and the floor's
        # working memory.
        "memory_bound": 4 * shards + root + 3 * largest + working,
    }


def measure_memory(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> dict[str, int]:
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        train_step(model, optim, tokens)
    peak = tracker.get_tracker_snapshot("peak")
    by_category = next(iter(peak.values()))
    return {getattr(k, "value", k): int(v) for k, v in by_category.items()}


def hidden_communication(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """On CUDA, the fraction of GPU time off the compute stream (collectives and their
    copies, on their own streams) that ran while the compute stream was busy, over three
    profiled steps."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            train_step(model, optim, tokens)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            spans.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    return hidden_fraction(spans)


def run(args: argparse.Namespace, device: torch.device) -> dict:
    models = {name: build(name, args, device) for name in CONTENDERS}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=args.lr) for name, m in models.items()}
    losses: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    step = 0
    for round_ in range(args.warmup + args.rounds):
        for name in CONTENDERS:  # interleaved: drift hits every contender alike
            start = time.perf_counter()
            for k in range(args.steps):
                loss = train_step(models[name], optims[name], batch(args, step + k, device))
                if name != "floor":
                    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                    losses[name].append(loss.item() / dist.get_world_size())
            synchronize(device)
            if round_ >= args.warmup:
                times[name].append((time.perf_counter() - start) / args.steps)
        step += args.steps

    tokens = batch(args, step, device)
    comm: dict[str, dict] = {}
    for name in ("fsdp_compose", "FSDP2"):
        with CollectiveCounter() as counter:
            train_step(models[name], optims[name], tokens)
        comm[name] = {"calls": counter.calls, "bytes": counter.bytes}
    comm["DDP"] = {"calls": {}, "bytes": ddp_bytes(models["DDP"])}
    memory = {name: measure_memory(models[name], optims[name], tokens) for name in CONTENDERS}
    hidden = None
    if device.type == "cuda":
        hidden = {n: hidden_communication(models[n], optims[n], tokens) for n in CONTENDERS[:3]}
    floor = analytic(args, models["floor"], memory["floor"])

    median = {name: statistics.median(t) for name, t in times.items()}
    reference = losses["FSDP2"]
    return {
        "config": {**vars(args), "world_size": dist.get_world_size(), "device": str(device),
                   "backend": dist.get_backend(), **provenance(device)},
        "step_seconds": median,
        "vs_fsdp2": {n: median[n] / median["FSDP2"] for n in CONTENDERS},
        "vs_floor": {n: median[n] / median["floor"] for n in CONTENDERS},
        "peak_memory": memory,
        "analytic": floor,
        "communication": comm,
        "max_loss_difference_vs_fsdp2": {
            n: max(abs(a - b) for a, b in zip(losses[n], reference)) for n in ("fsdp_compose", "DDP")
        },
        "losses": {n: losses[n] for n in ("fsdp_compose", "FSDP2", "DDP")},
        "mfu": mfu(args, median, device),
        "hidden_communication": hidden,
    }


def mfu(args: argparse.Namespace, median: dict[str, float], device: torch.device) -> dict[str, float] | None:
    """Model FLOPs utilisation on GPUs, with --peak-tflops (per GPU, the dtype trained)."""
    if device.type != "cuda" or args.peak_tflops is None:
        return None
    params = sum(p.numel() for p in GPT(args.vocab, args.dim, args.heads, args.depth, args.seq).parameters())
    tokens = args.batch * args.seq
    flops = 6 * params * tokens + 12 * args.depth * args.dim * args.seq * tokens  # fwd + bwd
    return {n: flops / t / (args.peak_tflops * 1e12) for n, t in median.items()}


def report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "step.json").write_text(json.dumps(result, indent=1, default=str))
    memory, bound = result["peak_memory"], result["analytic"]["memory_bound"]
    print(f"{'':14}{'step ms':>9}{'vs FSDP2':>10}{'vs floor':>10}{'peak KiB':>10}{'vs bound':>10}")
    for name in CONTENDERS:
        peak = memory[name]["Total"]
        print(f"{name:14}{result['step_seconds'][name] * 1e3:9.1f}{result['vs_fsdp2'][name]:10.2f}"
              f"{result['vs_floor'][name]:10.2f}{peak / 1024:10.0f}{peak / bound:10.2f}")
    print(f"memory bound per rank: {bound / 1024:.0f} KiB")
    for name, comm in result["communication"].items():
        print(f"{name:14}collectives {comm['calls'] or '-'}  bytes {comm['bytes']}")
    a = result["analytic"]
    print(f"{'floor':14}all_gather {a['all_gather_calls']} x, {a['all_gather_bytes']} B; "
          f"reduce_scatter {a['reduce_scatter_calls']} x, {a['reduce_scatter_bytes']} B")
    print(f"max |loss - FSDP2's|: {result['max_loss_difference_vs_fsdp2']}")
    for key in ("mfu", "hidden_communication"):
        if result[key] is not None:
            print(f"{key}: " + ", ".join(f"{n} {v:.3f}" for n, v in result[key].items()))
    from report import plot_step  # the chart of docs/performance.md

    if not plot_step(result, out / "step.png"):
        print("matplotlib not installed: no chart (pip install matplotlib)")
        return
    print(f"wrote {out / 'step.json'} and {out / 'step.png'}")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT's sizes, its batch and its training (what build, batch and train_step read)."""
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", type=lambda name: getattr(torch, name), default=torch.float32,
                        help="of the whole model and its training, e.g. bfloat16 on GPUs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1, help="rounds not timed")
    parser.add_argument("--peak-tflops", type=float, help="GPU peak, for MFU")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    start = time.perf_counter()
    result = run(args, init_distributed())
    result["config"]["wall_seconds"] = time.perf_counter() - start
    if dist.get_rank() == 0:
        report(result, args.out)
    gc.collect()  # meshes go before the process group (see examples/train_gpt.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
