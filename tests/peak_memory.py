"""Peak tracked memory per rank of fsdp_compose and torch's fully_shard, training the same
model on the fake process group (its collectives are synchronous, so peaks are exact).
Prints one JSON line: {world size: [ours, torch's]}. Run by tests/test_peak_memory.py as
`python -m tests.peak_memory zero_grad|accumulate` from the repository root."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compose import fully_shard
from tests.models import LINEAR_DIM, linear_stack

BATCH = 4


def peak(shard, world: int, zero_grad: bool) -> int:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = linear_stack()
    for layer in model:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, LINEAR_DIM)
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        for _ in range(3):
            model(x).sum().backward()
            optim.step()
            if zero_grad:
                optim.zero_grad()
            tracker.reset_mod_stats()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def main() -> None:
    zero_grad = sys.argv[1] == "zero_grad"
    peaks = {}
    for world in (2, 4, 8):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        peaks[world] = [
            peak(fully_shard, world, zero_grad), peak(torch_fully_shard, world, zero_grad)
        ]
        dist.destroy_process_group()
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()
