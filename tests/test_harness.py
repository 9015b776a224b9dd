"""The `ranks` fixture itself: a rank stuck in a collective fails the test, not the run;
a rank that crashes is run again once, and fails the test if it crashes again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def check_rank_zero_waits_alone() -> int:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return dist.get_rank()


def check_ranks() -> int:
    return dist.get_rank()


def test_hung_collective_fails_by_timeout_and_the_pool_restarts(ranks):
    with pytest.raises(AssertionError, match=r"ranks \[0\] did not finish \(hung collective\?\)"):
        ranks.run(check_rank_zero_waits_alone, world_size=2, timeout=5)
    assert ranks.run(check_ranks, world_size=2) == [0, 1]


def check_rank_one_crashes(marker: str) -> int:
    """Rank 1 aborts (a native crash: no Python error), every time, or with `marker` only
    while that file does not exist yet."""
    if dist.get_rank() == 1 and not (marker and Path(marker).exists()):
        if marker:
            Path(marker).touch()
        os.abort()
    return dist.get_rank()


def test_a_rank_that_crashes_once_runs_again_with_a_warning(ranks, tmp_path):
    with pytest.warns(RuntimeWarning, match=r"ranks \[1\] died \(exit codes \{1: -6\}\)"):
        assert ranks.run(check_rank_one_crashes, marker=str(tmp_path / "crashed")) == [0, 1]


def test_a_rank_that_crashes_twice_fails_the_test(ranks):
    with pytest.warns(RuntimeWarning), pytest.raises(AssertionError, match=r"ranks \[1\] died"):
        ranks.run(check_rank_one_crashes, marker="")
    assert ranks.run(check_ranks, world_size=2) == [0, 1]
