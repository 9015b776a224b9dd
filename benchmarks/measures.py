"""What benchmarks/step.py (and scale.py) measure besides time: what a step sends and copies,
counted at dispatch; the analytic floors those counts are held to (bytes each collective must
carry, bytes an FSDP step must copy outside its collectives, the memory bound); and on GPUs,
model FLOPs utilisation and the share of communication hidden under compute."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

COLLECTIVES = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
}
# Ops that copy data, by the kind they are reported under. torch's fully_shard wraps its
# copies in custom ops (fsdp::), whose insides a dispatch mode sees for some and not for
# others: each counts once, as the aten op it runs (all_gather_copy_in is a _foreach_copy_
# of the shards into the all-gather's input), and nothing inside it counts.
COPIES = {
    "aten::copy_": "copy_", "aten::_to_copy": "_to_copy", "aten::cat": "cat",
    "aten::_chunk_cat": "_chunk_cat", "aten::split_with_sizes_copy": "split_with_sizes_copy",
    "aten::_foreach_copy_": "_foreach_copy_", "aten::clone": "clone",
    "fsdp::all_gather_copy_in": "_foreach_copy_",
    "fsdp::split_with_sizes_copy": "split_with_sizes_copy", "fsdp::chunk_cat": "_chunk_cat",
}
GRAD_ADD = "grad add_"  # an add_ into a parameter's .grad: gradient accumulation
SCALED_COPY = "mul.out"  # DDP copies each gradient into its bucket divided by the world size


def nbytes(tree: object) -> int:
    """Bytes of the tensors in `tree`; a DTensor counts its local tensor (this rank's)."""
    tensors = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return sum(t._local_tensor.nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)


class Counter(TorchDispatchMode):
    """Calls and bytes by kind, of the ops `kind` names (None: not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def count(self, kind: str, payload: object) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes(payload)


class CollectiveCounter(Counter):
    """Collectives issued from Python, with their payload (output of an all-gather, input
    of a reduce-scatter, the tensor of an all-reduce)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = COLLECTIVES.get(func._schema.name)
        if kind is not None:
            self.count(kind, args[1] if kind == "reduce_scatter" else args[0])
        return func(*args, **(kwargs or {}))


class CopyCounter(Counter):
    """Copies dispatched outside the collectives, by kind (COPIES, GRAD_ADD, SCALED_COPY),
    with the bytes they write on this rank. A collective's own staging is not counted: in
    C++ below the dispatcher it is out of sight, and gloo's copy into a reduce-scatter's
    output is recognised."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.params = list(model.parameters())
        self._inside_custom_op = False
        # Outputs of reduce-scatters in flight: gloo reduces a copy of the input and copies
        # this rank's block into the output when the work is waited for, on the caller's
        # thread. That copy is the collective's own, not one outside it.
        self._reduce_outputs: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        kind = None if self._inside_custom_op else self._kind(name, args, kwargs)
        if kind is None or func.namespace != "fsdp":
            result = func(*args, **kwargs)
        else:
            self._inside_custom_op = True  # the ops it runs are counted as this one
            try:
                result = func(*args, **kwargs)
            finally:
                self._inside_custom_op = False
        if kind is not None:
            self.count(kind, written(name, args, kwargs, result))
        return result

    def result(self) -> dict:
        """For the JSON: calls and bytes by kind, and the total bytes."""
        return {"calls": self.calls, "bytes": self.bytes, "total_bytes": sum(self.bytes.values())}

    def _kind(self, name: str, args: tuple, kwargs: dict) -> str | None:
        if COLLECTIVES.get(name) == "reduce_scatter":
            outputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self._reduce_outputs.update(t.data_ptr() for t in outputs)
            return None
        if name == "aten::copy_" and args[0].data_ptr() in self._reduce_outputs:
            self._reduce_outputs.discard(args[0].data_ptr())
            return None
        if name == "aten::add_" and self._is_grad(args[0]):
            return GRAD_ADD
        if name == "aten::mul" and "out" in kwargs:
            return SCALED_COPY
        return COPIES.get(name)

    def _is_grad(self, tensor: object) -> bool:
        grads = (p.grad for p in self.params if p.grad is not None)
        return any(tensor is g or tensor is getattr(g, "_local_tensor", None) for g in grads)


def written(name: str, args: tuple, kwargs: dict, result: object) -> object:
    """What a copying op writes: its `out`, the destination of an in-place copy (all_gather_
    copy_in's sources have the destinations' sizes), or what it returns."""
    if "out" in kwargs:
        return kwargs["out"]
    return args[0] if name.endswith("_") or name == "fsdp::all_gather_copy_in" else result


def ddp_bytes(model: nn.Module) -> dict[str, int]:
    """DDP all-reduces every gradient once per step from C++ (not seen at dispatch)."""
    return {"all_reduce": sum(p.numel() * p.element_size() for p in model.parameters())}


def unit_numels(plain: nn.Module, world: int) -> tuple[list[int], int]:
    """Each block's numel and the root's, every parameter padded to `world` shards on dim 0
    (as both runtimes allocate them)."""

    def padded(params: list[nn.Parameter]) -> int:
        return sum(-(-p.shape[0] // world) * world * p[0].numel() for p in params)

    blocks = [padded(list(b.parameters())) for b in plain.blocks]
    return blocks, padded([p for n, p in plain.named_parameters() if not n.startswith("blocks.")])


def analytic(args: argparse.Namespace, plain: nn.Module, floor_peak: dict[str, int]) -> dict:
    """The floors: bytes each collective must carry, bytes copied outside them, and the
    paper's memory bound, whose working memory (activations and temporaries) is the
    floor's at its peak (`floor_peak`, by MemTracker's categories). Under --mixed-precision
    the all-gathers carry bfloat16 and the reduce-scatters float32."""
    world = dist.get_world_size()
    stored = next(plain.parameters()).element_size()  # the sharded parameters' dtype
    gathered = 2 if args.mixed_precision else stored
    reduced = 4 if args.mixed_precision else stored
    blocks, root = unit_numels(plain, world)
    largest = max(blocks)
    # Blocks are gathered in forward and again in backward; the root stays unsharded.
    all_gather = (2 * sum(blocks) + root) * gathered
    reduce_scatter = (sum(blocks) + root) * reduced
    return {
        "all_gather_bytes": all_gather, "reduce_scatter_bytes": reduce_scatter,
        "all_gather_calls": 2 * len(blocks) + 1, "reduce_scatter_calls": len(blocks) + 1,
        "ddp_all_reduce_bytes": ddp_bytes(plain)["all_reduce"],
        # Sharded params + grads + 2 AdamW moments (padding included), the root (unsharded
        # throughout) and the largest block computing with its gradient and the next
        # prefetched (and, under mixed precision, its gradient cast for the reduction), and
        # the floor's working memory.
        "memory_bound": 4 * ((sum(blocks) + root) // world) * stored
        + (root + 3 * largest) * gathered + (largest * reduced if args.mixed_precision else 0)
        + floor_peak["Activation"] + floor_peak["Temp"],
        **copy_floor(args.mixed_precision, all_gather // world, reduce_scatter),
    }


def copy_floor(mixed_precision: bool, gather_inputs: int, reduce_inputs: int) -> dict[str, int]:
    """Bytes an FSDP step must copy outside its collectives, per rank.

    A zero-copy design gathers nothing through a copy: each unit's shards stay in its
    all-gather's input, its unsharded parameters are views of the all-gather's output, and
    backward writes gradients straight into the reduce-scatter's input. Only the casts of
    mixed precision remain: each all-gather's input cast to param_dtype (per all-gather, as
    blocks are gathered twice) and the gradients cast once to reduce_dtype.

    One reduce-scatter per unit (fsdp_compose's, FSDP2's) cannot have the backward write into
    its input, where a parameter's rows for different ranks lie apart: it copies every
    gradient in once (the reduce_dtype cast is that copy): "copy_one_reduce_scatter_bytes".
    """
    param_cast = gather_inputs if mixed_precision else 0
    grad_cast = reduce_inputs if mixed_precision else 0
    return {"copy_gather_bytes": 0, "copy_param_cast_bytes": param_cast,
            "copy_grad_cast_bytes": grad_cast, "copy_bytes": param_cast + grad_cast,
            "copy_one_reduce_scatter_bytes": param_cast + reduce_inputs}


def mfu(args: argparse.Namespace, params: int, median: dict[str, float]) -> dict[str, float]:
    """Per contender, the FLOPs of a step over its median time, as a fraction of
    --peak-tflops (per GPU, in the dtype computed in): 6 per parameter and token (forward
    and backward) plus attention's 12 per layer, dim, position and token."""
    tokens = args.batch * args.seq
    flops = 6 * params * tokens + 12 * args.depth * args.dim * args.seq * tokens
    return {n: flops / t / (args.peak_tflops * 1e12) for n, t in median.items()}


def hidden_communication(step: Callable[[], object]) -> float:
    """The hidden fraction (below) of three profiled calls of `step`, from their trace."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
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


def hidden_fraction(spans: dict[int, list[tuple[float, float]]]) -> float:
    """Of the time some stream other than the compute stream (the one busy longest) is busy
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
