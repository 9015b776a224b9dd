"""Counting what a step sends: the c10d ops dispatched (by name, bytes and group size),
and the order of all-gathers, reduce-scatters and matrix multiplies."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ALL_GATHER = "c10d::_allgather_base_"


REDUCE_SCATTER = "c10d::_reduce_scatter_base_"


ALL_REDUCE = "c10d::allreduce_"


def _group_size(boxed: object) -> int:
    """The size of a process group as the dispatcher passes it (a boxed script object)."""
    return dist.ProcessGroup.unbox(boxed).size()


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d ops dispatched while active, by name. (CommDebugMode would do, but its module
    tracker fails when a module runs twice before backward.)"""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()  # of the whole buffer each collective works on
        self.group_sizes: Counter = Counter()  # by (name, size of its process group)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name
            if name in (ALL_GATHER, REDUCE_SCATTER):  # (output, input, group, ...)
                self._count(name, max(_nbytes(t) for t in args[:2]), args[2])
            elif name == ALL_REDUCE:  # (tensors, group, ...)
                self._count(name, sum(_nbytes(t) for t in args[0]), args[1])
            else:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, nbytes: int, group: object) -> None:
        self.counts[name] += 1
        self.bytes[name] += nbytes
        self.group_sizes[name, _group_size(group)] += 1


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class OpCounter(TorchDispatchMode):
    """Every op dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def first_forward(model: torch.nn.Module, *inputs: torch.Tensor) -> None:
    """Run the first forward untracked: it checks once that the ranks' models agree (a
    gather of their fingerprints), which is not per-step traffic. Then reshard, so the
    counted step starts, as the first one would, from sharded parameters."""
    with torch.no_grad():
        model(*inputs)
    for module in model.modules():
        if hasattr(module, "reshard"):  # annotated: by us or by torch
            module.reshard()


class GatherOrder(TorchDispatchMode):
    """All-gathers (by output size, which tells the units apart), matrix multiplies ("mm":
    a layer computing) and, if asked, reduce-scatters ("RS" and input size), in the order
    they were issued."""

    def __init__(self, reduce_scatters: bool = False) -> None:
        super().__init__()
        self.sizes: list[int | str] = []
        self.reduce_scatters = reduce_scatters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == ALL_GATHER:
            self.sizes.append(all_gather(args[0].numel()))
        elif func._schema.name == REDUCE_SCATTER and self.reduce_scatters:
            self.sizes.append(reduce_scatter(args[1].numel()))
        elif func._schema.name in ("aten::addmm", "aten::mm"):
            self.sizes.append(MATMUL)
        return func(*args, **(kwargs or {}))


# The entries of GatherOrder.sizes.
MATMUL = "mm"


def all_gather(numel: int) -> int:
    """An all-gather, by its output's size."""
    return numel


def reduce_scatter(numel: int) -> str:
    """A reduce-scatter, by its input's size."""
    return f"RS{numel}"
