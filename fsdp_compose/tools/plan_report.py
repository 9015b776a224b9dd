"""What plan() tells people: its plans as a table, how it ranks them, and which candidate
it is on (Progress, on stderr)."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from .plan_bytes import size
from .plan_setup import Plan


def table(plans: Sequence[Plan]) -> str:
    """`plans` as aligned columns: setup, peak per rank, bytes per step, (under a budget) verdict."""
    budgeted = any(p.fits is not None for p in plans)
    # Without a budget every verdict is "", and rstrip() drops its column.
    rows = [["setup", "peak per rank", "communicated per step", "verdict" if budgeted else ""]]
    rows += [[p.setup.describe(), p.peak_words(), "(not simulated)" if p.bytes_per_step is None
              else size(p.bytes_per_step), p.verdict()] for p in plans]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def ranking(budgeted: bool) -> str:
    """How plan() orders its plans (planner's _rank), in words."""
    costs = ("by less recomputation (a smaller share of blocks checkpointed), then no CPU "
             "offload, then fewer bytes communicated, then a lower peak")
    if not budgeted:
        return f"Ranked {costs}."
    return (f"Ranked: the setups that fit the budget first, {costs}; then those over it, the "
            "lowest simulated peak (the nearest miss) first; last, those a lower bound of the "
            "peak rules out without simulating, the lowest bound first.")


class Progress:
    """Which candidate plan() is on, on stderr: a line each, or on a terminal one line that
    rewrites itself with a bar."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.started = total, time.monotonic()
        # Looked up at the call, not import: tests and callers redirect it. None: say nothing.
        self.stream: TextIO | None = None if quiet else sys.stderr
        self.tty = self.stream is not None and self.stream.isatty()

    def show(self, k: int, what: str) -> None:
        line = f"candidate {k} of {self.total}, {time.monotonic() - self.started:.1f} s: {what}"
        done = 20 * (k - 1) // self.total
        self._say(f"[{'#' * done}{'.' * (20 - done)}] {line}" if self.tty else f"plan: {line}")

    def note(self, text: str) -> None:
        if self.stream is not None:
            print(f"plan: {text}", file=self.stream, flush=True)

    def finish(self, ruled_out: int) -> None:
        self._say(f"plan: {self.total} setups in {time.monotonic() - self.started:.1f} s, "
                  f"{ruled_out} ruled out by a lower bound without simulating", end="\n")

    def _say(self, line: str, end: str = "") -> None:
        if self.tty:  # over the last line; `end` "\n" ends it
            # Cut to the terminal's width: a line that wraps cannot be rewritten by \r.
            width = shutil.get_terminal_size().columns - 1
            print("\r" + line[:width].ljust(width), end=end, file=self.stream, flush=True)
        elif self.stream is not None:
            print(line, file=self.stream, flush=True)
