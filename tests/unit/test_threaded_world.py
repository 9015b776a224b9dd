"""fully_shard under a threaded process group (torch's MultiThreadedTestCase world, which
framework test suites and torch's own FSDP2 tests use): ranks are threads of one process,
and each test builds a world of its own, so nothing may outlive a world (the groups of
reshard_after_forward=<int> and separate reduce-scatter groups included)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms

from fsdp_compose import fully_shard

RESULTS: dict[int, float] = {}


@spawn_threads_and_init_comms(world_size=4)
def train_one_step(_self: object) -> None:
    """Every rank gets the same batch, so its averaged gradient is the reference's."""
    ref = nn.Sequential(nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 5))
    with torch.no_grad():  # the same values on every thread: the global generator is shared
        for i, p in enumerate(ref.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (4,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)  # a post-forward group of 2
        layer.set_separate_reduce_scatter_group()
    fully_shard(model, mesh=mesh)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for m in (ref, model):
        m(x).square().mean().backward()
    RESULTS[dist.get_rank()] = max(
        (p.grad.full_tensor() - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), ref.parameters())
    )


def test_worlds_built_one_after_another_train_alike() -> None:
    # DTensor enters a FakeTensorMode on each rank's first parameter; on a CUDA build without
    # a GPU, torch 2.11 crashes (SIGSEGV) when threads enter the first one at the same time.
    # Entering one here first, in the main thread, is what any user of threaded worlds needs.
    with FakeTensorMode():
        pass
    for _ in range(2):  # the second world must not reach the first world's groups
        RESULTS.clear()
        train_one_step(object())
        assert sorted(RESULTS) == [0, 1, 2, 3]
        assert max(RESULTS.values()) < 1e-6
