"""The `ranks` fixture itself: a rank stuck in a collective fails the test, not the run."""

from __future__ import annotations

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
