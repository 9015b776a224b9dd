"""When a rank fails before a collective, the others do not hang: within the process group's
timeout they raise an error naming the unit and the collective they waited in."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compose import fully_shard
from tests.dist.parity import per_block
from tests.models import MLP


def check_waiting_rank_names_unit_and_collective() -> None:
    # A group of its own with a short timeout: the test waits 3 s, not the pool's 60 s.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = MLP()
    per_block(model, lambda m, **kw: fully_shard(m, mesh=mesh))
    model(torch.ones(1, 8)).sum().backward()  # one step on both ranks
    if dist.get_rank() == 1:
        return  # this rank "crashed" before the next forward
    with pytest.raises(RuntimeError, match=r"(?s)fsdp_compose: the all-gather of unit "
                       r"layers\.0 over 2 ranks failed on rank 0: .*Another rank probably "
                       r"raised or stopped before this collective.*init_process_group\(\.\.\., "
                       r"timeout="):
        model(torch.ones(1, 8))


def test_waiting_rank_names_unit_and_collective(ranks):
    ranks.run(check_waiting_rank_names_unit_and_collective, world_size=2, retire_pool=True)
