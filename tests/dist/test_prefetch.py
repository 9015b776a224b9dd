"""Explicit prefetch: set_modules_to_forward_prefetch / set_modules_to_backward_prefetch
start the next units' all-gathers early. Training is unchanged (parity with single-process
and torch's fully_shard with the same prefetch), and the all-gathers are issued in the
same order as torch's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import fully_shard
from tests.dist.parity import Shard, train_and_compare
from tests.models import MLP, feature_batch

ALL_GATHER = "c10d::_allgather_base_"


def mse_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x[:, :1]).pow(2).mean()


def with_prefetch(model: nn.Module, shard: Shard) -> None:
    """A unit per layer; each layer prefetches the next in forward, the previous in backward."""
    layers = list(model.layers)
    for layer in layers:
        shard(layer)
    shard(model)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[i - 1 : i] if i else [])


def check_prefetch_parity() -> tuple[float, float]:
    return train_and_compare(MLP, mse_loss, feature_batch, wrap=with_prefetch)


def test_prefetch_trains_like_single_process_and_torch(ranks):
    vs_reference, vs_torch = ranks.run(check_prefetch_parity, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6


class GatherOrder(TorchDispatchMode):
    """All-gathers (by output size, which tells the units apart) and matrix multiplies
    ("mm": a layer computing), in the order they were issued."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int | str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == ALL_GATHER:
            self.sizes.append(args[0].numel())
        elif func._schema.name in ("aten::addmm", "aten::mm"):
            self.sizes.append("mm")
        return func(*args, **(kwargs or {}))


def gather_order(shard: Shard) -> list[int]:
    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with_prefetch(model, lambda m, **kw: shard(m, mesh=mesh, **kw))
    x = feature_batch(0, 2)
    with torch.no_grad():
        model(x)  # the first forward: one-time checks
    for module in model.modules():
        if hasattr(module, "reshard"):
            module.reshard()
    with GatherOrder() as order:
        mse_loss(model, x).backward()
    return order.sizes


def check_gather_order() -> tuple[list[int], list[int]]:
    return gather_order(fully_shard), gather_order(torch_fully_shard)


def test_prefetch_issues_all_gathers_in_torchs_order(ranks):
    ours, theirs = ranks.run(check_gather_order, world_size=2)[0]
    # Layers 8->7, 7->5, 5->3, 3->1 padded for 2 ranks gather 72, 48, 24 and 8 elements.
    # Forward: each layer's gather of the next is issued before the layer computes.
    forward = ours[: ours.index(8) + 3]
    assert forward == [72, 48, "mm", 24, "mm", 8, "mm", "mm"], ours
    # Backward: the last layer again, then each layer prefetches the previous one before
    # computing its gradients.
    assert [x for x in ours[len(forward):] if x != "mm"] == [8, 24, 48, 72], ours
    # All in torch's order, except that torch gathers the last layer once more at the end
    # of backward, which nothing uses.
    extra = len(theirs) - 1 - theirs[::-1].index(8)
    assert theirs[:extra] + theirs[extra + 1 :] == ours, (ours, theirs)


def check_prefetch_needs_annotated_modules() -> None:
    model = MLP()
    fully_shard(model.layers[0])
    with pytest.raises(ValueError, match=r"set_modules_to_forward_prefetch: \['Linear'\] are "
                       "not annotated"):
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])


def test_prefetch_needs_annotated_modules(ranks):
    ranks.run(check_prefetch_needs_annotated_modules, world_size=2)
