"""What plan() tells people: its plans as a table, how it ranks them (ranking) and, while
it simulates, which candidate it is on (Progress, on stderr)."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence

from .plan_bytes import size
from .plan_setup import Plan


def table(plans: Sequence[Plan]) -> str:
    """`plans` as aligned rows under a header: the setup, its peak per rank, the bytes it
    communicates per step and (under a budget) whether it fits."""
    budgeted = any(p.fits is not None for p in plans)
    rows = [["setup", "peak per rank", "communicated per step"] + (["verdict"] if budgeted else [])]
    for p in plans:
        sent = "(not simulated)" if p.bytes_per_step is None else size(p.bytes_per_step)
        rows.append([p.setup.describe(), p.peak_words(), sent] + ([p.verdict()] if budgeted else []))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows
    )


def ranking(budgeted: bool) -> str:
    """How plan() orders its plans (what planner's _rank does), in words."""
    costs = ("by less recomputation (a smaller share of blocks checkpointed), then no CPU "
             "offload, then fewer bytes communicated, then a lower peak")
    if not budgeted:
        return f"Ranked {costs}."
    return (f"Ranked: the setups that fit the budget first, {costs}; then those over it, the "
            "lowest simulated peak (the nearest miss) first; last, those a lower bound of the "
            "peak rules out without simulating, the lowest bound first.")


class Progress:
    """Which candidate plan() is on, on stderr, so that minutes of simulating are not
    silent: one line each, or on a terminal one line that rewrites itself with a bar."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet, self.started = total, quiet, time.monotonic()
        self.stream = sys.stderr  # at the call, not import: tests and callers redirect it
        self.tty = not quiet and self.stream is not None and self.stream.isatty()

    def show(self, k: int, what: str) -> None:
        """Candidate `k` (from 1) is `what`."""
        if self.quiet or self.stream is None:
            return
        line = f"candidate {k} of {self.total}, {time.monotonic() - self.started:.1f} s: {what}"
        if not self.tty:
            print(f"plan: {line}", file=self.stream, flush=True)
            return
        done = 20 * (k - 1) // self.total
        self._overwrite(f"[{'#' * done}{'.' * (20 - done)}] {line}")

    def note(self, text: str) -> None:
        if not self.quiet and self.stream is not None:
            print(f"plan: {text}", file=self.stream, flush=True)

    def finish(self, ruled_out: int) -> None:
        if self.quiet or self.stream is None:
            return
        line = (f"plan: {self.total} setups in {time.monotonic() - self.started:.1f} s, "
                f"{ruled_out} ruled out by a lower bound without simulating")
        if self.tty:
            self._overwrite(line)
            line = ""  # ends the rewritten line
        print(line, file=self.stream, flush=True)

    def _overwrite(self, line: str) -> None:
        # Cut to the terminal's width: a line that wraps cannot be rewritten by \r.
        width = shutil.get_terminal_size().columns - 1
        self.stream.write("\r" + line[:width].ljust(width))
        self.stream.flush()
