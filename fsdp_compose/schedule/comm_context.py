"""The collectives a root's units have in flight, and how many they may have.

Units start all-gathers ahead of use (prefetch) and leave reduce-scatters running while
the next unit's backward computes. Both hold buffers until they are waited for, so both
are bounded: at most `max_all_gathers` prefetched gathers not yet copied out (a fast CPU
thread cannot run the allocator ahead of the collectives), and at most
`max_reductions` reduce-scatters with their input buffers. Every rank issues and waits in
the same order, as the hooks run in the same order everywhere.

Roots that share one (`share_comm_ctx`, e.g. pipeline stages) share the bounds.
"""

from __future__ import annotations

from collections import deque

from ..unit.unit import Unit


class CommContext:
    def __init__(self) -> None:
        self.max_all_gathers = 2
        self.max_reductions = 1
        self.changed_by: str | None = None  # the module whose setter changed a bound
        self._gathers: list[Unit] = []  # started asynchronously, oldest first
        self._reductions: deque[Unit] = deque()

    def prefetch(self, unit: Unit) -> None:
        """Start `unit`'s all-gather without waiting; its unshard() finishes it."""
        if unit.is_unsharded or unit.gather_in_flight or not unit.params:
            return
        gathers = self._gathers
        if len(gathers) >= self.max_all_gathers:
            # Gathers finished since (their unit ran) no longer count.
            gathers[:] = [u for u in gathers if u.gather_in_flight]
            while len(gathers) >= self.max_all_gathers:
                gathers.pop(0).wait_for_unshard()
        unit.unshard(async_op=True)
        gathers.append(unit)

    def reduce(self, unit: Unit) -> None:
        """Start `unit`'s gradient reduction; `finish_reductions` (or a later one) ends it."""
        while len(self._reductions) >= self.max_reductions:
            self._reductions.popleft().finish_reduction()
        if unit.reduce_grads():
            self._reductions.append(unit)

    def finish_reductions(self) -> None:
        """Wait for every reduction in flight, oldest first (the end of backward)."""
        while self._reductions:
            self._reductions.popleft().finish_reduction()
