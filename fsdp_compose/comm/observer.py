"""The runtime's one observer slot. While one is set (StepTrace, while open), the runtime tells
it when each part issues and waits for its collectives and when each unit's backward begins
and ends."""

from __future__ import annotations

from typing import Protocol

ISSUE_GATHER, WAIT_GATHER = "all-gather", "all-gather wait"
ISSUE_REDUCE, WAIT_REDUCE = "reduce-scatter", "reduce-scatter wait"


class Observer(Protocol):
    def begin(self, part: object, event: str) -> None:
        """`part` (a MeshPart) begins `event`."""

    def end(self, part: object, event: str, nbytes: int = 0) -> None:
        """`part` ended `event`; an issue says how many bytes it sends (0: nothing)."""

    def backward_began(self, state: object) -> None:
        """A unit's (UnitState's) backward began: its parameters are gathered."""

    def backward_done(self, state: object) -> None:
        """A unit's backward computed all its gradients (reduced next, unless without sync)."""


current: Observer | None = None


def observe(observer: Observer | None) -> None:
    global current
    current = observer
