"""Training step time, host time, peak memory, communication and copies: fsdp_compose,
torch's fully_shard (FSDP2), DDP and a single-process floor (the plain model on each rank's
batch), interleaved in rounds on the same weights and batches; the counts against the analytic
floors; on CUDA, MFU and the communication compute hides; the deterministic loss comparison.

    torchrun --nproc_per_node=2 benchmarks/step.py   # CPU, gloo (CONTRIBUTING.md: on GPUs)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness
import report
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from train_gpt import GPT, counting_batch, init_distributed

# cuBLAS picks its algorithms deterministically with this, read at its first use: the loss
# parity runs can then be compared bit for bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

CONTENDERS, SHARDED = report.CONTENDERS, report.SHARDED
MODELS = {"gpt": GPT, "llama": harness.Llama}
LR = 3e-3
COLLECTIVES = {"c10d::_allgather_base_": "all_gather", "c10d::allreduce_": "all_reduce",
               "c10d::_reduce_scatter_base_": "reduce_scatter",
               "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter"}
# Copying ops by the kind they count as. torch's fully_shard wraps its copies in custom ops
# (fsdp::), whose insides a dispatch mode sees for some and not others: each counts once, as
# the aten op it runs (all_gather_copy_in: a _foreach_copy_), and nothing inside it counts.
COPIES = {
    "aten::copy_": "copy_", "aten::_to_copy": "_to_copy", "aten::cat": "cat",
    "aten::_chunk_cat": "_chunk_cat", "aten::split_with_sizes_copy": "split_with_sizes_copy",
    "aten::_foreach_copy_": "_foreach_copy_", "aten::clone": "clone",
    "fsdp::all_gather_copy_in": "_foreach_copy_",
    "fsdp::split_with_sizes_copy": "split_with_sizes_copy", "fsdp::chunk_cat": "_chunk_cat",
}


class Counter(TorchDispatchMode):
    """Calls and bytes (a DTensor's on this rank) by kind: in `sent`, the collectives issued
    from Python, with their payload (an all-gather's output, a reduce-scatter's input, an
    all-reduce's tensor); in `calls` and `bytes`, the copies outside them, with the bytes they
    write, also adds into a `.grad` (accumulation) and DDP's copies into its buckets (mul.out,
    divided by the world size). A collective's own staging is not counted: below the
    dispatcher it is out of sight, and gloo's copy into a reduce-scatter's output, on the
    caller's thread, is recognised."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.params = list(model.parameters())
        self.inside_custom_op, self.reduce_outputs = False, set()  # of reduce-scatters in flight
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.sent: dict[str, dict[str, int]] = {"calls": {}, "bytes": {}}

    def count(self, kind: str, payload: object, into: dict | None = None) -> None:
        calls, sizes = (into["calls"], into["bytes"]) if into else (self.calls, self.bytes)
        calls[kind] = calls.get(kind, 0) + 1
        sizes[kind] = sizes.get(kind, 0) + sum(
            t._local_tensor.nbytes if isinstance(t, DTensor) else t.nbytes
            for t in tree_leaves(payload) if isinstance(t, torch.Tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, func._schema.name
        sent = COLLECTIVES.get(name)
        if sent is not None:
            self.count(sent, args[1] if sent == "reduce_scatter" else args[0], self.sent)
        kind = None if self.inside_custom_op else self.kind(name, args, kwargs)
        outer = kind is not None and func.namespace == "fsdp"
        self.inside_custom_op |= outer  # the ops it runs count as this one
        try:
            result = func(*args, **kwargs)
        finally:
            self.inside_custom_op &= not outer
        if kind is not None:  # what it writes; all_gather_copy_in's sources have its sizes
            self.count(kind, kwargs["out"] if "out" in kwargs else args[0] if name.endswith("_")
                       or name == "fsdp::all_gather_copy_in" else result)
        return result

    def result(self) -> dict:
        return {"calls": self.calls, "bytes": self.bytes, "total_bytes": sum(self.bytes.values())}

    def kind(self, name: str, args: tuple, kwargs: dict) -> str | None:
        if COLLECTIVES.get(name) == "reduce_scatter":
            outputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.reduce_outputs.update(t.data_ptr() for t in outputs)
            return None
        if name == "aten::copy_" and args[0].data_ptr() in self.reduce_outputs:
            self.reduce_outputs.discard(args[0].data_ptr())
            return None
        if name == "aten::add_" and any(args[0] is g or args[0] is getattr(g, "_local_tensor", g)
                                        for g in (p.grad for p in self.params) if g is not None):
            return "grad add_"
        return "mul.out" if name == "aten::mul" and "out" in kwargs else COPIES.get(name)


def analytic(args: argparse.Namespace, plain: nn.Module, floor_peak: dict[str, int]) -> dict:
    """The floors: bytes each collective must carry, bytes copied outside them, and the memory
    bound, whose activations and temporaries are the floor's at its peak (`floor_peak`).
    Under --mixed-precision the all-gathers carry bfloat16 and the reduce-scatters float32.
    Every parameter is padded to W shards on dim 0, as both runtimes allocate them."""
    world = dist.get_world_size()
    stored = next(plain.parameters()).element_size()
    gathered, reduced = (2, 4) if args.mixed_precision else (stored, stored)

    def padded(params: list[nn.Parameter]) -> int:
        return sum(-(-p.shape[0] // world) * world * p[0].numel() for p in params)

    blocks = [padded(list(b.parameters())) for b in plain.blocks]
    root = padded([p for n, p in plain.named_parameters() if not n.startswith("blocks.")])
    largest = max(blocks)
    # Blocks are gathered in forward and again in backward; the root stays unsharded.
    all_gather, reduce_scatter = (2 * sum(blocks) + root) * gathered, (sum(blocks) + root) * reduced
    # A zero-copy design copies only mixed precision's casts: each all-gather's input to
    # param_dtype and the gradients once to reduce_dtype. With one reduce-scatter per unit,
    # whose input holds a parameter's rows for different ranks apart, backward cannot write
    # the gradients into it: each is copied in once (the reduce_dtype cast is that copy).
    param_cast = all_gather // world if args.mixed_precision else 0
    grad_cast = reduce_scatter if args.mixed_precision else 0
    return {
        "all_gather_bytes": all_gather, "reduce_scatter_bytes": reduce_scatter,
        "all_gather_calls": 2 * len(blocks) + 1, "reduce_scatter_calls": len(blocks) + 1,
        "ddp_all_reduce_bytes": sum(p.nbytes for p in plain.parameters()),
        # Sharded parameters, gradients and AdamW's 2 moments, the root, the largest block
        # computing with its gradient and the next prefetched (under mixed precision also its
        # gradient cast for the reduction), and the floor's working memory.
        "memory_bound": 4 * ((sum(blocks) + root) // world) * stored
        + (root + 3 * largest) * gathered + (largest * reduced if args.mixed_precision else 0)
        + floor_peak["Activation"] + floor_peak["Temp"],
        "copy_gather_bytes": 0, "copy_param_cast_bytes": param_cast,
        "copy_grad_cast_bytes": grad_cast, "copy_bytes": param_cast + grad_cast,
        "copy_one_reduce_scatter_bytes": param_cast + reduce_scatter,
    }


def hidden_communication(step: Callable[[], object]) -> float:
    """The hidden fraction (below) of three profiled calls of `step`."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(str(Path(folder) / "trace.json"))
        events = json.loads((Path(folder) / "trace.json").read_text())["traceEvents"]
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            spans.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    return hidden_fraction(spans)


def hidden_fraction(spans: dict[int, list[tuple[float, float]]]) -> float:
    """Of the time other streams than the compute stream (the one busy longest) are busy
    (collectives and their copies), the fraction the compute stream is busy too. `spans`:
    (start, end) per stream."""
    if len(spans) < 2:
        return 1.0  # nothing ran beside the compute stream
    compute = max(spans, key=lambda s: sum(end - start for start, end in spans[s]))
    busy = union(spans[compute])
    side = union([span for s, stream in spans.items() if s != compute for span in stream])
    total = sum(end - start for start, end in side)
    hidden = sum(max(0.0, min(end, b_end) - max(start, b_start))
                 for start, end in side for b_start, b_end in busy)
    return hidden / total if total else 1.0


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def make_model(args: argparse.Namespace) -> nn.Module:
    return MODELS[args.model](args.vocab, args.dim, args.heads, args.depth, args.seq)


def build(name: str, args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same weights for every contender
    model = make_model(args).to(device, args.dtype)
    if args.compile:
        for block in model.blocks:  # in place, as torchtitan does: names and hooks stay
            block.compile(backend=args.compile_backend)
    if name == "DDP":
        return DistributedDataParallel(model, device_ids=None if device.index is None
                                       else [device.index])
    if name in SHARDED:
        dtypes = (torch.bfloat16, torch.float32) if args.mixed_precision else ()
        harness.shard(model, model.blocks, name, *dtypes,
                      mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    return model


class Contender:
    """A model, its AdamW (fused on CUDA) and, for DDP and the floor under --mixed-precision,
    bfloat16 autocast."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device, lr: float = LR):
        self.model = build(name, args, device)
        # fused=None, not False, off CUDA: False would also turn off the foreach default.
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=lr,
                                       fused=device.type == "cuda" or None)
        self.autocast = torch.bfloat16 if args.mixed_precision and name not in SHARDED else None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return train_step(self.model, self.optim, tokens, self.autocast)


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


def measure_memory(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor,
                   autocast: torch.dtype | None = None) -> dict[str, int]:
    """MemTracker's peak by category; on CUDA also the allocator's peak above what the step
    started with (every contender's model lives on the device)."""
    cuda = tokens.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(tokens.device)
        torch.cuda.reset_peak_memory_stats(tokens.device)
        resident = torch.cuda.memory_allocated(tokens.device)
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        train_step(model, optim, tokens, autocast)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    if cuda:
        peak["allocator step peak"] = torch.cuda.max_memory_allocated(tokens.device) - resident
    return {getattr(k, "value", k): int(v) for k, v in peak.items()}


def timed_rounds(args: argparse.Namespace, contenders: dict[str, Contender],
                 device: torch.device) -> tuple[dict, dict, dict]:
    """Seconds per step in each round, seconds to issue each step, and each step's loss."""
    step, host, losses = ({name: [] for name in CONTENDERS} for _ in range(3))
    for round_ in range(args.warmup + args.rounds):
        timed = round_ >= args.warmup
        for name, c in contenders.items():
            start = time.perf_counter()
            for k in range(args.steps):
                tokens = batch(args, round_ * args.steps + k, device)
                issued = time.perf_counter()
                loss = c.step(tokens)
                if timed:  # on CUDA the kernels may still run: this is the host's share
                    host[name].append(time.perf_counter() - issued)
                if name != "floor":
                    losses[name].append(mean_loss(loss))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if timed:
                step[name].append((time.perf_counter() - start) / args.steps)
    return step, host, losses


def mean_loss(loss: torch.Tensor) -> float:
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    return loss.item() / dist.get_world_size()


def loss_parity(args: argparse.Namespace, device: torch.device) -> dict:
    """The losses of --parity-steps steps at --parity-lr (where the model trains) of
    fsdp_compose, FSDP2 and FSDP2 again (the run-to-run noise ours is read against), from the
    same weights on the same batches, deterministic where torch can be, with one attention
    kernel (flash on CUDA, whose backward is deterministic there). Eager even under --compile:
    three more compilations would cost minutes."""
    args = argparse.Namespace(**{**vars(args), "compile": False})
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if device.type == "cuda" \
        else [SDPBackend.MATH]
    losses: dict[str, list[float]] = {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn where torch has none
    try:
        for run_name in ("fsdp_compose", "FSDP2", "FSDP2 again"):
            c = Contender(run_name.removesuffix(" again"), args, device, lr=args.parity_lr)
            with sdpa_kernel(kernels):
                losses[run_name] = [mean_loss(c.step(batch(args, step, device)))
                                    for step in range(args.parity_steps)]
            del c
            gc.collect()
            torch.cuda.empty_cache()  # nothing without CUDA
    finally:
        torch.use_deterministic_algorithms(deterministic)
    reference = losses["FSDP2"]
    return {"steps": args.parity_steps, "lr": args.parity_lr, "losses": losses,
            "max_difference_vs_fsdp2": {
                n: max((abs(a - b) for a, b in zip(losses[n], reference)), default=0.0)
                for n in ("fsdp_compose", "FSDP2 again")},
            "loss_falls": bool(reference) and reference[-1] < reference[0]}


def run(args: argparse.Namespace, device: torch.device) -> dict:
    contenders = {name: Contender(name, args, device) for name in CONTENDERS}
    step, host, losses = timed_rounds(args, contenders, device)
    tokens = batch(args, (args.warmup + args.rounds) * args.steps, device)
    comm, copies = {}, {}
    for name, c in contenders.items():  # a step's collectives and copies outside them
        with Counter(c.model) as copied:
            c.step(tokens)
        # DDP all-reduces every gradient once, from C++: unseen at dispatch.
        comm[name] = copied.sent if name != "DDP" else {
            "calls": {}, "bytes": {"all_reduce": sum(p.nbytes for p in c.model.parameters())}}
        copies[name] = copied.result()
    # The model's own copies in the FSDPs' compute dtype (a bfloat16 RMSNorm computes in
    # float32, the loss copies its targets): a contender's beyond them are its runtime's.
    plain = build("floor", args, device).to(torch.bfloat16 if args.mixed_precision else args.dtype)
    with Counter(plain) as copied:
        train_step(plain, torch.optim.SGD(plain.parameters()), tokens)
    copies["model"] = copied.result()
    memory = {name: measure_memory(c.model, c.optim, tokens, c.autocast)
              for name, c in contenders.items()}
    median = {name: statistics.median(t) for name, t in step.items()}
    hidden = utilisation = None
    if device.type == "cuda":
        hidden = {n: hidden_communication(lambda c=contenders[n]: c.step(tokens))
                  for n in CONTENDERS[:3]}
        if args.peak_tflops is not None:  # FLOPs: 6 per parameter and token, attention's 12
            with torch.device("meta"):  # per layer, dim, position and token
                params = sum(p.numel() for p in make_model(args).parameters())
            flops = args.batch * args.seq * (6 * params + 12 * args.depth * args.dim * args.seq)
            utilisation = {n: flops / t / (args.peak_tflops * 1e12) for n, t in median.items()}
    floor = analytic(args, contenders["floor"].model, memory["floor"])
    del contenders  # the parity runs build their own, one at a time
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "config": harness.config(args, device, world_size=dist.get_world_size(),
                                 device=str(device), backend=dist.get_backend()),
        "step_seconds": median,
        "host_seconds": {name: statistics.median(t) for name, t in host.items()},
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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt",
                        help="the GPT of examples/train_gpt.py or the Llama of harness.py")
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
                        help="steps of the deterministic loss comparison")
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
        parity = result["loss_parity"]
        print(report.step_table(result), report.bytes_table(result), report.copies_table(result),
              f"max |loss - FSDP2's| over the timed steps: "
              f"{result['max_loss_difference_vs_fsdp2']}; in {parity['steps']} deterministic "
              f"steps at lr {parity['lr']} (FSDP2's loss {parity['losses']['FSDP2'][0]:.4f} -> "
              f"{parity['losses']['FSDP2'][-1]:.4f}): " + ", ".join(
                  f"{n} {v:.3g}" for n, v in parity["max_difference_vs_fsdp2"].items()),
              sep="\n\n")
        if report.plot_step(result, args.out / "step.png"):
            print(f"wrote {args.out / 'step.png'}")
    gc.collect()  # meshes go before the process group (see examples/train_gpt.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
