"""The runtime's one observer slot. While an Observer is set here (StepTrace, while open),
the runtime tells it when each part issues and waits for its collectives and when each
unit's backward begins; unset, each such event costs the runtime one None check."""

from __future__ import annotations

from typing import Protocol

# The events, by what the runtime is doing.
ISSUE_GATHER, WAIT_GATHER = "all-gather", "all-gather wait"
ISSUE_REDUCE, WAIT_REDUCE = "reduce-scatter", "reduce-scatter wait"


class Observer(Protocol):
    def begin(self, part: object, event: str) -> None:
        """`part` (a MeshPart) begins `event`."""

    def end(self, part: object, event: str, nbytes: int = 0) -> None:
        """`part` ended `event`; an issue says how many bytes its collective moves (0: it
        had nothing to send)."""

    def backward_began(self, state: object) -> None:
        """A unit's (UnitState's) backward began: its parameters are gathered."""


current: Observer | None = None


def observe(observer: Observer | None) -> None:
    """Set (or, with None, clear) the observer."""
    global current
    current = observer
