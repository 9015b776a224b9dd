"""The per-unit work of fully_shard written out by hand, with nothing else: the cost of the
design itself, which benchmarks/overhead.py sets beside the runtimes.

Each `nn.Linear` gets what a unit of either runtime does in a forward and a backward: its
two shards in one flat tensor, all-gathered into a buffer (kept allocated here; the runtimes
free theirs) and copied out into one unsharded storage that is freed after forward (resized
to 0) and gathered again for backward; a hook on each unsharded parameter's gradient
accumulation that, after the last, chunks the gradients into one reduce-scatter that
averages, and adds the result to the shards' `.grad`. It calls the same process-group
methods as fsdp_compose (none on one rank, as both runtimes). Left out is all a runtime is
for: DTensors, checks, a root, prefetch, mixed precision, any other module or mesh, errors,
state dicts. Only for this benchmark's model; not a runtime.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions

# The process group's two methods, called as fsdp_compose calls them (their names vary).
from fsdp_compose.comm.compat import all_gather_single, reduce_scatter_single

_GATHER = AllgatherOptions()
_AVERAGE = dist.ReduceScatterOptions()
_AVERAGE.reduceOp = dist.ReduceOp.AVG


class HandShardedLinear:
    """One `nn.Linear` sharded on dim 0 over the default group (dims divisible by its size)."""

    def __init__(self, linear: nn.Linear) -> None:
        group = dist.group.WORLD
        self.group, self.ranks, rank = group, group.size(), group.rank()
        self.linear, self.names = linear, list(linear._parameters)
        unsharded = [linear._parameters[name] for name in self.names]
        assert all(p is not None and p.shape[0] % self.ranks == 0 for p in unsharded)
        self.sizes = [p.numel() // self.ranks for p in unsharded]
        flat = torch.cat([p.detach().reshape(self.ranks, -1)[rank] for p in unsharded])
        self.flat = flat  # this rank's shards, back to back: what the all-gather sends
        self.sharded = {  # views of flat, shaped as torch.chunk's dim-0 pieces
            n: nn.Parameter(s.view(-1, *p.shape[1:]))
            for n, s, p in zip(self.names, flat.split(self.sizes), unsharded)
        }
        storage = torch.empty(self.ranks * flat.numel())
        pieces = storage.split([self.ranks * size for size in self.sizes])
        self.unsharded = {
            n: nn.Parameter(piece.view(p.shape)) for n, piece, p in zip(self.names, pieces, unsharded)
        }
        # .data: the copy-out must not bump the version autograd saved the parameters at.
        self.targets = [self.unsharded[n].data.view(self.ranks, -1) for n in self.names]
        self.storage, self.nbytes = storage.untyped_storage(), storage.nbytes
        self.storage.resize_(0)
        self.gathered = torch.empty(self.ranks, flat.numel())  # row r: rank r's shards
        self.grads_pending = 0
        for param in self.unsharded.values():
            param.register_post_accumulate_grad_hook(self.grad_accumulated)
        linear._parameters.update(self.sharded)
        linear.register_forward_pre_hook(self.pre_forward)
        linear.register_forward_hook(self.post_forward)

    def unshard(self) -> None:
        self.storage.resize_(self.nbytes)
        if self.ranks > 1:
            all_gather_single(self.group, self.gathered.view(-1), self.flat, _GATHER).wait()
        else:  # as both runtimes, nothing to send
            self.gathered.view(-1).copy_(self.flat)
        torch.split_with_sizes_copy(self.gathered, self.sizes, dim=1, out=self.targets)
        self.linear._parameters.update(self.unsharded)

    def reshard(self) -> None:
        self.linear._parameters.update(self.sharded)
        self.storage.resize_(0)

    def pre_forward(self, module: nn.Module, args: object) -> None:
        self.unshard()

    def post_forward(self, module: nn.Module, args: object, output: torch.Tensor) -> None:
        self.reshard()
        output.grad_fn.register_prehook(self.pre_backward)

    def pre_backward(self, grads: object) -> None:
        self.grads_pending = len(self.names)
        self.unshard()

    def grad_accumulated(self, _param: nn.Parameter) -> None:
        self.grads_pending -= 1
        if self.grads_pending:
            return
        grads = []
        for param in self.unsharded.values():
            grads.append(param.grad)
            param.grad = None
        rows = torch._chunk_cat(grads, dim=0, num_chunks=self.ranks)  # row r: rank r's
        reduced = rows.new_empty(self.flat.numel())
        if self.ranks > 1:
            reduce_scatter_single(self.group, reduced, rows.view(-1), _AVERAGE).wait()
        else:
            reduced.copy_(rows.view(-1))
        for name, grad in zip(self.names, torch.split_with_sizes(reduced, self.sizes)):
            shard = self.sharded[name]
            if shard.grad is None:
                shard.grad = grad.view(shard.shape)
            else:
                shard.grad.add_(grad.view(shard.shape))
        self.reshard()


def shard_by_hand(model: nn.Sequential) -> None:
    """Shard each Linear of `model` (its hooks keep their state alive)."""
    for layer in model:
        HandShardedLinear(layer)
