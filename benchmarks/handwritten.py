"""The per-unit work of fully_shard written out by hand, with nothing else: the cost of the
design itself, set beside the runtimes by overhead.py. As a unit of fsdp_compose on the CPU:
padded shards back to back in one flat tensor, one all-gather into a reused buffer, one
`split_with_sizes_copy` into unsharded parameters viewing one storage; after the last gradient,
one `_chunk_cat` and one averaging reduce-scatter added to the shards' `.grad`. Left out is all
a runtime is for: DTensors, checks, a root, prefetch, mixed precision, meshes, errors, state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions

# The process group's all-gather and reduce-scatter, as fsdp_compose calls them.
from fsdp_compose.comm.compat import ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD

_GATHER = AllgatherOptions()
_AVERAGE = dist.ReduceScatterOptions()
_AVERAGE.reduceOp = dist.ReduceOp.AVG


def _shard(p: torch.Tensor, ranks: int, rank: int, piece: torch.Tensor) -> nn.Parameter:
    """`rank`'s torch.chunk piece of `p` written into `piece` (its padded shard, zero past the
    piece), as a parameter viewing it."""
    rows = -(-p.shape[0] // ranks)
    local = p.detach()[rank * rows:(rank + 1) * rows]
    piece.zero_()
    piece[:local.numel()].copy_(local.reshape(-1))
    return nn.Parameter(piece[:local.numel()].view(local.shape))


class HandShardedUnit:
    """The parameters of `module` sharded on dim 0 over the default group, as one unit."""

    def __init__(self, module: nn.Module) -> None:
        group = dist.group.WORLD
        self.group, self.ranks, rank = group, group.size(), group.rank()
        owned = [(m._parameters, n, p) for m in module.modules()
                 for n, p in m._parameters.items() if p is not None]
        self.count = len(owned)
        # Each parameter's padded shard: ceil(rows / ranks) rows, as both runtimes pad.
        self.sizes = [-(-p.shape[0] // self.ranks) * p[0].numel() for _, _, p in owned]
        self.flat = torch.empty(sum(self.sizes))  # this rank's shards: what is sent
        self.shards = list(self.flat.split(self.sizes))
        sharded = [_shard(p, self.ranks, rank, s) for (_, _, p), s in zip(owned, self.shards)]
        if self.ranks == 1:  # the shards are the unsharded data: nothing to gather or free
            unsharded_data, self.outputs, self.storage = self.shards, [], None
        else:
            storage = torch.empty(self.ranks * self.flat.numel())
            unsharded_data = storage.split([self.ranks * size for size in self.sizes])
            # Through .data, which has its own version counter: the copy-out must not bump
            # the one autograd checks on the unsharded parameters it saved. Each output is
            # a parameter's rows, one per rank, as the gathered rows hold its shards.
            self.outputs = [data.view(self.ranks, size) for data, size in zip(
                storage.data.split([self.ranks * size for size in self.sizes]), self.sizes)]
            self.storage, self.nbytes = storage.untyped_storage(), storage.nbytes
            # The all-gather's buffer (row r: rank r's flat shard), allocated per gather.
            self.gathered = torch.empty(self.ranks * self.flat.numel())
            self.rows = self.gathered.view(self.ranks, -1)
            self.gathered_storage = self.gathered.untyped_storage()
            self.gathered_nbytes = self.gathered.nbytes
            self.gathered_storage.resize_(0)
        unsharded = [nn.Parameter(data[:p.numel()].view(p.shape))
                     for data, (_, _, p) in zip(unsharded_data, owned)]
        self.forms = self._by_owner(owned, sharded, unsharded)
        self.sharded, self.unsharded = sharded, unsharded
        self.grads_pending = 0
        self.grad_views: list[torch.Tensor] = []  # see add_to_grads
        offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]  # in the reduced shards
        self.grad_geometry = [(s.shape, s.stride(), o) for s, o in zip(sharded, offsets)]
        for param in unsharded:
            param.register_post_accumulate_grad_hook(self.grad_accumulated)
        self.reshard()
        module.register_forward_pre_hook(self.pre_forward)
        module.register_forward_hook(self.post_forward)

    @staticmethod
    def _by_owner(owned: list, sharded: list, unsharded: list) -> list:
        """(owner's _parameters, sharded by name, unsharded by name): one dict update each."""
        forms: dict[int, tuple] = {}
        for (parameters, name, _), s, u in zip(owned, sharded, unsharded):
            _, s_by_name, u_by_name = forms.setdefault(id(parameters), (parameters, {}, {}))
            s_by_name[name], u_by_name[name] = s, u
        return list(forms.values())

    def unshard(self) -> None:
        if self.storage is not None:
            self.gathered_storage.resize_(self.gathered_nbytes)
            getattr(self.group, ALL_GATHER_METHOD)(self.gathered, self.flat, _GATHER).wait()
            self.storage.resize_(self.nbytes)
            torch.split_with_sizes_copy(self.rows, self.sizes, dim=1, out=self.outputs)
            self.gathered_storage.resize_(0)
        for parameters, _, unsharded in self.forms:
            parameters.update(unsharded)

    def reshard(self) -> None:
        for parameters, sharded, _ in self.forms:
            parameters.update(sharded)
        if self.storage is not None:
            self.storage.resize_(0)

    def pre_forward(self, module: nn.Module, args: object) -> None:
        self.unshard()

    def post_forward(self, module: nn.Module, args: object, output: torch.Tensor) -> None:
        self.reshard()
        output.grad_fn.register_prehook(self.pre_backward)

    def pre_backward(self, grads: object) -> None:
        self.grads_pending = self.count
        self.unshard()

    def grad_accumulated(self, _param: nn.Parameter) -> None:
        self.grads_pending -= 1
        if self.grads_pending:
            return
        grads = []
        for param in self.unsharded:
            grads.append(param.grad)
            param.grad = None
        if self.ranks == 1:  # as fsdp_compose: each gradient is its own reduced shard
            for shard, grad in zip(self.sharded, grads):
                if shard.grad is None:
                    shard.grad = grad
                else:
                    shard.grad.add_(grad)
            self.reshard()
            return
        rows = torch._chunk_cat(grads, dim=0, num_chunks=self.ranks)  # row r: rank r's
        reduced = rows.new_empty(self.flat.numel())
        getattr(self.group, REDUCE_SCATTER_METHOD)(reduced, rows.view(-1), _AVERAGE).wait()
        self.add_to_grads(reduced)
        self.reshard()

    def add_to_grads(self, reduced: torch.Tensor) -> None:
        """Add the reduced shards (padded, back to back) to the shards' `.grad`s: with one op
        while those are the views of an earlier `reduced` that this made them (gradient
        accumulation, as fsdp_compose's ledger does), else each on its own."""
        if self.grad_views and all(s.grad is g for s, g in zip(self.sharded, self.grad_views[1:])):
            self.grad_views[0].add_(reduced)
            return
        views = [reduced]
        for shard, (shape, stride, offset) in zip(self.sharded, self.grad_geometry):
            grad = reduced.as_strided(shape, stride, offset)  # one view op for three
            views.append(grad)
            if shard.grad is None:
                shard.grad = grad
            else:
                shard.grad.add_(grad)
        # Kept only when every .grad is now a view of `reduced` (all were None).
        fresh = all(s.grad is g for s, g in zip(self.sharded, views[1:]))
        self.grad_views = views if fresh else []


def shard_by_hand(model: nn.Sequential) -> None:
    """Shard each module of `model` as a unit (its hooks keep their state alive)."""
    for layer in model:
        HandShardedUnit(layer)
