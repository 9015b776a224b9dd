"""A unit's gradient ledger: every gradient held back between a backward and the sharded
`.grad`s, as pending (this backward's) or committed (earlier backwards').

Note [gradients per backward]: a backward's gradients count only once it has finished (the
end of backward commits); until then the ledger keeps apart what it may still undo. A
backward that raised is discarded, leaving what earlier backwards accumulated as it was.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..param.sharded_param import ShardedParam


class GradLedger:
    def __init__(self, params: list[ShardedParam]) -> None:
        self._params = params
        # Committed: the unsharded sums of backwards without gradient sync (in reduce_dtype),
        # and the HSDP partial sums of backwards without all-reduce.
        self._accumulated: dict[ShardedParam, torch.Tensor] = {}
        self._partial: dict[ShardedParam, torch.Tensor] = {}
        # Pending: this backward's reduced shards, which committed sums a reduction spent,
        # the HSDP partial sums it made, and which earlier ones an all-reduce spent.
        self._pending_shard: dict[ShardedParam, torch.Tensor] = {}
        self._spent_accumulated: set[ShardedParam] = set()
        self._pending_partial: dict[ShardedParam, torch.Tensor] = {}
        self._spent_partial: set[ShardedParam] = set()

    def nbytes(self) -> int:
        """What the ledger holds (reduced shards, and sums kept between backwards)."""
        kept = [*self._pending_shard.values(), *self._accumulated.values(),
                *self._partial.values(), *self._pending_partial.values()]
        return sum(t.nbytes for t in kept)

    # -- unsharded gradients ---------------------------------------------------------------

    def has_unsharded_grads(self) -> bool:
        return bool(self._accumulated) or any(p.unsharded.grad is not None for p in self._params)

    def take_unsharded(self, p: ShardedParam) -> torch.Tensor | None:
        """p's unsharded gradient summed since the last reduction (the earlier sum kept till
        commit)."""
        grad = p.pop_unsharded_grad()
        accumulated = self._accumulated.get(p)
        if accumulated is None or p in self._spent_accumulated:
            return grad
        self._spent_accumulated.add(p)  # a second reduction in this backward excludes it
        return accumulated if grad is None else accumulated + grad

    # -- HSDP partial sums (set_requires_all_reduce(False)) --------------------------------

    def has_partial(self, p: ShardedParam) -> bool:
        """Whether `p` has a partial sum to take (so it takes part in the reduction)."""
        return p in self._pending_partial or (p in self._partial and p not in self._spent_partial)

    def take_partial(self, p: ShardedParam) -> torch.Tensor | None:
        """p's partial sum so far (an earlier reduction's in this backward; none once spent)."""
        if p in self._pending_partial:
            return self._pending_partial.pop(p)
        return None if p in self._spent_partial else self._partial.get(p)

    def keep_partial(self, shards: Iterable[tuple[ShardedParam, torch.Tensor]]) -> None:
        """The reduced shards of a reduction without all-reduce: the new partial sums."""
        self._pending_partial.update(shards)

    def spend_partial(self, params: Iterable[ShardedParam]) -> None:
        """An all-reduce included these parameters' sums: they start again from zero."""
        self._spent_partial.update(params)

    # -- reduced shards ----------------------------------------------------------------------

    def hold(self, params: list[ShardedParam], sizes: list[int], reduced: torch.Tensor) -> None:
        """Keep reduced shards (`sizes` each) until backward ends; a second reduction adds."""
        pending = self._pending_shard
        for p, shard in zip(params, torch.split_with_sizes(reduced, sizes)):
            earlier = pending.get(p)
            pending[p] = shard if earlier is None else earlier + shard

    # -- the end of a backward ---------------------------------------------------------------

    def commit(self) -> None:
        """The backward finished: its reduced shards join the sharded `.grad`s, its unreduced
        gradients the unsharded sums (in reduce_dtype), its partial sums replace the old."""
        reduced, self._pending_shard = self._pending_shard, {}
        for p, shard in reduced.items():
            p.add_to_grad(shard)
        if self._spent_accumulated:
            for p in self._spent_accumulated:
                del self._accumulated[p]
            self._spent_accumulated = set()
        for p in self._params:
            if p.unsharded.grad is not None:  # a backward without reduction
                grad = p.pop_unsharded_grad()
                assert grad is not None
                if (accumulated := self._accumulated.get(p)) is None:
                    # In reduce_dtype: summing in place, autograd would keep param_dtype.
                    self._accumulated[p] = grad.to(p.reduce_dtype)
                else:
                    accumulated.add_(grad)
        if self._spent_partial or self._pending_partial:
            for p in self._spent_partial:
                self._partial.pop(p, None)
            self._partial.update(self._pending_partial)
            self._spent_partial, self._pending_partial = set(), {}
        for p in reduced:
            p.run_grad_hooks()

    def discard(self) -> None:
        """The backward did not finish: forget its gradients, keep the earlier ones."""
        for p in self._params:
            p.unsharded.grad = None
        self._pending_shard, self._spent_accumulated = {}, set()
        self._spent_partial, self._pending_partial = set(), {}
