"""A unit's phases in an iteration and the moves allowed between them, and whether the
autograd engine is in a backward (which tells a recomputation from a forward)."""

from __future__ import annotations

import enum

import torch


class Phase(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


# The phases each phase may go to. Tuples: their membership test compares identities,
# while a set or dict would hash the enum member with a Python-level __hash__.
_NEXT = (
    (Phase.IDLE, (Phase.FORWARD, Phase.PRE_BACKWARD)),
    (Phase.FORWARD, (Phase.IDLE, Phase.FORWARD)),  # FORWARD again: another module of a list unit
    (Phase.PRE_BACKWARD, (Phase.PRE_BACKWARD, Phase.POST_BACKWARD)),
    # A part of the graph whose inputs did not require grad reaches the unit again after
    # its reduction; it is unsharded and reduced once more (grads accumulate correctly).
    (Phase.POST_BACKWARD, (Phase.PRE_BACKWARD,)),
)
for _phase, _next in _NEXT:
    _phase.next = _next  # type: ignore[attr-defined]
# The members as module globals, which the hooks read at every call: a member looked up on
# its enum class costs as much as a function call (Python 3.11).
IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = Phase


# The autograd engine's graph task on this thread, -1 outside backward (the hot hooks call
# it directly, a function call less). Private: see docs/design.md.
current_graph_task_id = torch._C._current_graph_task_id


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return current_graph_task_id() != -1
