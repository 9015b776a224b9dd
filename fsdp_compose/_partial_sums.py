"""HSDP gradient accumulation without all-reduce (`set_requires_all_reduce(False)`).

Each backward reduce-scatters a unit's gradients within its shard group only; the shards
are summed here, per parameter, until a backward all-reduces across replicas again and
spends the sum. As with every gradient (Note [gradients per backward] in _param.py), a
backward's changes count only once it finishes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._param import ShardedParam


class PartialSums:
    def __init__(self) -> None:
        self._sums: dict[ShardedParam, torch.Tensor] = {}  # from finished backwards
        # This backward's changes to them, applied when it finishes.
        self._pending: dict[ShardedParam, torch.Tensor] = {}
        self._spent: set[ShardedParam] = set()

    def has(self, p: ShardedParam) -> bool:
        """Whether `p` has a partial sum to take (then it takes part in the reduction)."""
        return p in self._pending or (p in self._sums and p not in self._spent)

    def take(self, p: ShardedParam) -> torch.Tensor | None:
        """p's partial sum so far, including an earlier reduction in this backward, but not
        one an all-reduce already spent."""
        if p in self._pending:
            return self._pending.pop(p)
        return None if p in self._spent else self._sums.get(p)

    def keep(self, shards: Iterable[tuple[ShardedParam, torch.Tensor]]) -> None:
        """The reduced shards of a reduction without all-reduce: the new partial sums."""
        self._pending.update(shards)

    def spend(self, params: Iterable[ShardedParam]) -> None:
        """An all-reduce included these parameters' sums: they start again from zero."""
        self._spent.update(params)

    def commit(self) -> None:
        """The backward finished: its changes count."""
        for p in self._spent:
            self._sums.pop(p, None)
        self._sums.update(self._pending)
        self.discard()

    def discard(self) -> None:
        """The backward did not finish: forget its changes."""
        self._spent, self._pending = set(), {}
