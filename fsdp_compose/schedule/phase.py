"""A unit's phases in an iteration and the moves allowed between them, and whether the
autograd engine is in a backward (which tells a recomputation from a forward)."""

from __future__ import annotations

import torch


class Phase:
    """A named phase and the phases a unit may go to from it."""

    __slots__ = ("name", "next")

    def __init__(self, name: str) -> None:
        self.name = name
        self.next: tuple[Phase, ...] = ()

    def __repr__(self) -> str:
        return self.name


IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = (
    Phase(name) for name in ("IDLE", "FORWARD", "PRE_BACKWARD", "POST_BACKWARD")
)
IDLE.next = (FORWARD, PRE_BACKWARD)
FORWARD.next = (IDLE, FORWARD)  # FORWARD again: another module of a list unit
PRE_BACKWARD.next = (PRE_BACKWARD, POST_BACKWARD)
# A part of the graph whose inputs did not require grad reaches the unit again after its
# reduction; it is unsharded and reduced once more (grads accumulate correctly).
POST_BACKWARD.next = (PRE_BACKWARD,)


# The autograd engine's graph task on this thread, -1 outside backward. Private: see
# docs/design.md.
current_graph_task_id = torch._C._current_graph_task_id


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return current_graph_task_id() != -1
