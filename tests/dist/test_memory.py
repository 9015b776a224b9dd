"""What stays allocated after a backward: only the parameter and gradient shards, nothing
unsharded and no communication buffer. (Peaks against torch's: tests/test_peak_memory.py.)"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_compose import fully_shard
from tests.models import LINEAR_DIM, linear_stack

CPU = torch.device("cpu")


def padded_bytes(model: nn.Module, world: int) -> int:
    """Every parameter's padded shard (ceil(dim0 / world) rows), in float32."""
    return sum(
        -(-p.shape[0] // world) * math.prod(p.shape[1:]) * 4 for p in model.parameters()
    )


def check_only_shards_stay_allocated(zero_grad: bool) -> None:
    """Three steps under MemTracker, with zero_grad(set_to_none=True) between them or
    adding into the gradients."""
    torch.manual_seed(0)
    model = linear_stack()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(4, LINEAR_DIM)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        for _ in range(3):
            model(x).sum().backward()
            assert_only_shards(model, tracker)
            tracker.reset_mod_stats()  # MemTracker's per-module figures are per iteration
            if zero_grad:
                model.zero_grad(set_to_none=True)


def assert_only_shards(model: nn.Module, tracker: MemTracker) -> None:
    expected = 2 * padded_bytes(model, dist.get_world_size())  # parameter and gradient shards
    for _ in range(100):
        current = tracker.get_tracker_snapshot("current")[CPU]["Total"]
        if current == expected:
            return
        # gloo's worker threads let go of a finished collective's tensors a moment later.
        time.sleep(0.02)
    raise AssertionError(f"{current} bytes allocated after backward, expected {expected}")


@pytest.mark.parametrize("zero_grad", [True, False])
def test_only_shards_stay_allocated_after_backward(ranks, zero_grad):
    for world in (1, 2, 4):
        ranks.run(check_only_shards_stay_allocated, world_size=world, zero_grad=zero_grad)
