"""What a training step of benchmarks/step.py sends and copies, counted at dispatch, and the
analytic floors the counts are held to (bytes each collective must carry, bytes an FSDP
step must copy outside its collectives, and the memory bound)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
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
    "aten::copy_": "copy_",
    "aten::_to_copy": "_to_copy",
    "aten::cat": "cat",
    "aten::_chunk_cat": "_chunk_cat",
    "aten::split_with_sizes_copy": "split_with_sizes_copy",
    "aten::_foreach_copy_": "_foreach_copy_",
    "aten::clone": "clone",
    "fsdp::all_gather_copy_in": "_foreach_copy_",
    "fsdp::split_with_sizes_copy": "split_with_sizes_copy",
    "fsdp::chunk_cat": "_chunk_cat",
}
GRAD_ADD = "grad add_"  # an add_ into a parameter's .grad: gradient accumulation
SCALED_COPY = "mul.out"  # DDP copies each gradient into its bucket divided by the world size


def nbytes(tree: object) -> int:
    """Bytes of the tensors in `tree`; a DTensor counts its local tensor (this rank's)."""
    tensors = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return sum(t._local_tensor.nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)


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
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes(payload)
        return func(*args, **(kwargs or {}))


class CopyCounter(TorchDispatchMode):
    """Copies dispatched outside the collectives, by kind (COPIES, GRAD_ADD, SCALED_COPY),
    with the bytes they write on this rank. A collective's own staging is not counted: in
    C++ below the dispatcher it is out of sight, and gloo's copy into a reduce-scatter's
    output is recognised. torch.compile runs no graph while a dispatch mode is
    active (dynamo skips the frame): under --compile the counted step runs eagerly."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.params = list(model.parameters())
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._inside_custom_op = False
        # Outputs of reduce-scatters in flight: gloo reduces a copy of the input and copies
        # this rank's block into the output when the work is waited for, on the caller's
        # thread. That copy is the collective's own, not one outside it.
        self._reduce_outputs: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        kind = None if self._inside_custom_op else self._kind(name, args, kwargs)
        if kind is not None and func.namespace == "fsdp":
            self._inside_custom_op = True
            try:
                result = func(*args, **kwargs)
            finally:
                self._inside_custom_op = False
        else:
            result = func(*args, **kwargs)
        if kind is not None:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes(_written(name, args, kwargs, result))
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
        for p in self.params:
            grad = p.grad
            if grad is not None and (tensor is grad or tensor is getattr(grad, "_local_tensor", None)):
                return True
        return False


def _written(name: str, args: tuple, kwargs: dict, result: object) -> object:
    """What a copying op writes: its `out`, the destination of an in-place copy (all_gather_
    copy_in's sources have the destinations' sizes), or what it returns."""
    if "out" in kwargs:
        return kwargs["out"]
    if name.endswith("_") or name == "fsdp::all_gather_copy_in":
        return args[0]
    return result


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


def analytic(args: argparse.Namespace, plain: nn.Module, floor_peak: dict[str, int]) -> dict[str, float]:
    """The floors: bytes each collective must carry, bytes copied outside them, and the
    paper's memory bound, whose working memory (activations and temporaries) is the
    floor's at its peak (`floor_peak`, measure_memory's categories). Under
    --mixed-precision the all-gathers carry bfloat16 and the reduce-scatters float32."""
    world = dist.get_world_size()
    stored = next(plain.parameters()).element_size()  # the sharded parameters' dtype
    gathered = 2 if args.mixed_precision else stored
    reduced = 4 if args.mixed_precision else stored
    blocks, root = unit_numels(plain, world)
    shards = (sum(blocks) + root) // world  # per rank, padding included
    largest = max(blocks)
    all_gather = (2 * sum(blocks) + root) * gathered
    reduce_scatter = (sum(blocks) + root) * reduced
    return {
        # Blocks are gathered in forward and again in backward; the root stays unsharded.
        "all_gather_bytes": all_gather,
        "reduce_scatter_bytes": reduce_scatter,
        "all_gather_calls": 2 * len(blocks) + 1,
        "reduce_scatter_calls": len(blocks) + 1,
        "ddp_all_reduce_bytes": sum(p.numel() * p.element_size() for p in plain.parameters()),
        # Sharded params + grads + 2 AdamW moments, the root (unsharded throughout) and the
        # largest block computing with its gradient and the next prefetched (and, under
        # mixed precision, its gradient cast for the reduction), and the floor's working
        # memory.
        "memory_bound": 4 * shards * stored + (root + 3 * largest) * gathered
        + (largest * reduced if args.mixed_precision else 0)
        + floor_peak["Activation"] + floor_peak["Temp"],
        **copy_floor(args.mixed_precision, all_gather // world, reduce_scatter),
    }


def copy_floor(mixed_precision: bool, gather_inputs: int, reduce_inputs: int) -> dict[str, int]:
    """Bytes an FSDP step must copy outside its collectives, per rank.

    Gathers copy nothing: a zero-copy design keeps each unit's shards in its all-gather's
    input and its unsharded parameters as views of the all-gather's output, and has the
    backward write gradients straight into the reduce-scatter's input. Only the casts of
    mixed precision remain: each all-gather's input is the shard cast to param_dtype (once
    per all-gather: blocks are gathered twice, as in the floor of collectives), and the
    gradients, computed in param_dtype, are cast once to reduce_dtype, into the
    reduce-scatter's input. Without mixed precision the floor is 0.

    A design with one reduce-scatter per unit (fsdp_compose's, FSDP2's) cannot have the
    backward write gradients into its input: a parameter's rows for different ranks lie
    apart there. It copies every gradient into that input once (the reduce_dtype cast is
    the same copy): "copy_one_reduce_scatter_bytes".
    """
    param_cast = gather_inputs if mixed_precision else 0
    grad_cast = reduce_inputs if mixed_precision else 0
    return {"copy_gather_bytes": 0, "copy_param_cast_bytes": param_cast,
            "copy_grad_cast_bytes": grad_cast, "copy_bytes": param_cast + grad_cast,
            "copy_one_reduce_scatter_bytes": param_cast + reduce_inputs}
