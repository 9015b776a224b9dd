"""Which units a unit starts gathering once it is unsharded, so that their all-gathers
overlap its compute (CommContext bounds how many are in flight).

Explicit lists come from `set_modules_to_forward_prefetch` and
`set_modules_to_backward_prefetch`. Without one, backward prefetches the unit whose forward
ended just before this one's (the next to run backward), and forward, after
`set_implicit_forward_prefetch`, the unit whose forward began just after this one's in the
last iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

U = TypeVar("U")  # a unit's state


class Prefetch(Generic[U]):
    """One unit's prefetch targets."""

    def __init__(self) -> None:
        self.forward: list[U] = []  # explicit
        self.backward: list[U] | None = None  # explicit; None: implicit
        self.implicit_forward = False
        self.forward_index = -1  # the unit's place in this iteration's forward order
        self.ended_forward_before: tuple[U, ...] = ()  # set as the unit's forward ends

    def in_forward(self, unit: U, last_order: list[U]) -> list[U]:
        """The units to start gathering as `unit`'s forward begins (`last_order`: the last
        iteration's forward order)."""
        if self.forward or not self.implicit_forward:
            return self.forward
        i = self.forward_index + 1
        return last_order[i : i + 1] if len(last_order) > i and last_order[i - 1] is unit else []

    def in_backward(self) -> Sequence[U]:
        """The units to start gathering as this unit's backward begins."""
        return self.ended_forward_before if self.backward is None else self.backward
