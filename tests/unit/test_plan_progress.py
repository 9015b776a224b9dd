"""plan() while it runs: it says on stderr which candidate it is on (a line each, or on a
terminal one line that rewrites itself; nothing when quiet), and under a budget it skips
the simulation of a setup whose lower bound of the peak already exceeds the budget. That
bound is below the simulated peak of every candidate, so no setup that fits is skipped."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch

from fsdp_compose import Setup, plan
from fsdp_compose.tools import planner
from fsdp_compose.tools.planner import candidates, model_sizes, peak_lower_bound
from tests.models import Transformer, lm_loss, token_batch

TWO = [Setup(), Setup(blocks_per_unit=2, checkpoint_every=1)]


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(depth=2)


def run(**options: object) -> list[planner.Plan]:
    return plan(tiny, world_size=2, sample_input=token_batch(0, 2), loss_fn=lm_loss, **options)


def test_a_line_per_candidate_on_stderr_says_which_setup_and_when(capsys):
    run(setups=TWO)
    out, err = capsys.readouterr()
    assert out == "" and "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 3, err
    assert re.fullmatch(r"plan: candidate 1 of 2, [\d.]+ s: simulating 1 block\(s\)/unit, "
                        r"reshard_after_forward=True, no activation checkpointing", lines[0])
    assert re.fullmatch(r"plan: candidate 2 of 2, [\d.]+ s: simulating 2 block\(s\)/unit, "
                        r"reshard_after_forward=True, activation checkpointing of every block",
                        lines[1])
    assert re.fullmatch(r"plan: 2 setups in [\d.]+ s, 0 ruled out by a lower bound without "
                        r"simulating", lines[2])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_rewrites_itself(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    run(setups=TWO)
    text = terminal.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended once done
    frames = text.rstrip("\n").split("\r")[1:]
    assert len(frames) == 3 and len({len(f) for f in frames}) == 1  # each overwrites the last
    assert frames[0].startswith("[....................] candidate 1 of 2, ")
    assert frames[1].startswith("[##########..........] candidate 2 of 2, ")
    assert frames[2].startswith("plan: 2 setups in ")


def test_quiet_says_nothing(capsys, monkeypatch):
    run(setups=TWO, quiet=True)
    assert capsys.readouterr() == ("", "")
    monkeypatch.setattr(sys, "stderr", terminal := _Terminal())
    run(setups=TWO, quiet=True, memory_budget="1KiB")
    assert terminal.getvalue() == ""


def test_a_setup_its_bound_rules_out_is_not_simulated_and_says_so(capsys, monkeypatch):
    def no_simulation(*args: object) -> None:
        raise AssertionError("simulated")

    monkeypatch.setattr(planner, "_simulate", no_simulation)
    plans = run(setups=TWO, memory_budget="1KiB")
    assert all(not p.simulated and p.fits is False and p.bytes_per_step is None for p in plans)
    assert all("at least" in str(p) for p in plans)
    err = capsys.readouterr().err
    assert re.search(r"^plan: candidate 1 of 2, [\d.]+ s: not simulated "
                     r"\(peak at least [\d.]+ \w+, over the budget\): 1 block\(s\)/unit",
                     err, re.MULTILINE), err
    assert "2 ruled out by a lower bound without simulating" in err


@pytest.mark.parametrize(("world_size", "depth", "tie_weights"), [(1, 2, False), (4, 3, True)])
def test_the_lower_bound_is_below_every_candidates_simulated_peak(world_size, depth, tie_weights):
    """At one rank the unsharded parameters are the shards (no copy); at four, units of 1,
    2 and 3 blocks, reshard_after_forward True, False and 2, every checkpointing, and a
    head that shares the embedding's weight."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return Transformer(dim=32, heads=4, depth=depth, tie_weights=tie_weights)

    batch, setups = token_batch(0, 8), candidates(world_size, depth)
    plans = plan(build, world_size=world_size, sample_input=batch, loss_fn=lm_loss, quiet=True)
    assert {p.setup for p in plans} == set(setups) and all(p.simulated for p in plans)
    sizes = model_sizes(build, "blocks", batch, lm_loss, torch.device("cpu"), {None, 1, 2})
    bounds = {p.setup: peak_lower_bound(sizes, p.setup, world_size) for p in plans}
    assert all(0 < bounds[p.setup] <= p.peak_bytes for p in plans), [
        (p.setup, bounds[p.setup], p.peak_bytes) for p in plans if bounds[p.setup] > p.peak_bytes]
    # And not vacuous: without checkpointing (the forward's activations at their most) it
    # is over half the peak.
    no_checkpointing = [p for p in plans if p.setup.checkpoint_every is None]
    assert all(bounds[p.setup] > 0.5 * p.peak_bytes for p in no_checkpointing)
