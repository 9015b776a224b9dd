"""Everything fsdp_compose changes for the whole process, owned here. Each piece is installed
only while something that needs it lives and removed after (`installed()` lists what is now):

- the local optimizer step (param/local_step.py): torch.optim's elementwise functions and
  their classes' `_init_group` wrapped, and an optimizer step pre-hook that refuses replaced
  tensors; while any sharded parameter lives (its id in `local_step.SHARDED_IDS` as long);
- the unmanaged-parameter watch (schedule/unmanaged.py): a module forward pre-hook, from
  fully_shard until a root's first forward, or until its units are gone;
- the observer slot (`observer`): a StepTrace while it is open.

The user's own, undone by them: `replace_torch_fsdp` (api/torch_switch.py) and the launcher's
startup hook (startup/). Caches keyed by weak reference (comm/meshes.py's derived groups) go
with their keys."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

ISSUE_GATHER, WAIT_GATHER = "all-gather", "all-gather wait"
ISSUE_REDUCE, WAIT_REDUCE = "reduce-scatter", "reduce-scatter wait"


class Observer(Protocol):
    """Told when each part issues and waits for its collectives and when each unit's
    backward begins and ends."""

    def begin(self, part: object, event: str) -> None:
        """`part` (a MeshPart) begins `event`."""

    def end(self, part: object, event: str, nbytes: int = 0) -> None:
        """`part` ended `event`; an issue says how many bytes it sends (0: nothing)."""

    def backward_began(self, state: object) -> None:
        """A unit's (UnitState's) backward began: its parameters are gathered."""

    def backward_done(self, state: object) -> None:
        """A unit's backward computed all its gradients (reduced next, unless without sync)."""


observer: Observer | None = None


def observe(new: Observer | None) -> None:
    global observer
    observer = new


class Piece:
    """One process-wide change: `install()` makes it and returns what undoes it."""

    def __init__(self, name: str, install: Callable[[], Callable[[], None]]) -> None:
        self.name = name
        self._install = install
        self._undo: Callable[[], None] | None = None
        self._holders = 0
        _PIECES.append(self)

    def hold(self, holder: object) -> None:
        """Install the piece (if it is not) until `holder` and every other holder are gone."""
        if self._undo is None:
            self._undo = self._install()
        self._holders += 1
        weakref.finalize(holder, self._release)

    def _release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self.remove()

    def remove(self) -> None:
        """Undo the piece now (a later `hold` installs it again)."""
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()


_PIECES: list[Piece] = []


def installed() -> list[str]:
    """The pieces installed now, by name."""
    return [piece.name for piece in _PIECES if piece._undo is not None]
