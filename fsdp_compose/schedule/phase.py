"""A unit's phases in an iteration and the moves allowed between them, and whether the
autograd engine is in a backward (which tells a recomputation from a forward)."""

from __future__ import annotations

import enum

import torch


class Phase(enum.Enum):
    """A unit's phase; `next`: the phases it may go to from it."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()

    next: tuple[Phase, ...]


IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = Phase
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
