"""Copies and edits of an annotated model: deepcopy is refused clearly; parameters replaced
or frozen after annotation are handled, in parity with the same edit on the reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compose import fully_shard
from tests.dist.parity import assert_close_to, backward, per_block, whole_pairs
from tests.models import MLP, feature_batch, mse_loss


def check_deepcopy_is_refused() -> None:
    model = MLP()
    per_block(model, fully_shard)
    with pytest.raises(TypeError, match=r"copy\.deepcopy\(FSDPMLP\): an annotated module "
                       r"cannot be deep-copied .* Copy the model before fully_shard"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match=r"copy\.deepcopy\(FSDPLinear\)"):
        copy.deepcopy(nn.Sequential(model.layers[0]))  # a plain parent of a unit


def test_deepcopy_is_refused(ranks):
    ranks.run(check_deepcopy_is_refused, world_size=2)


def check_replace_and_freeze_after_annotation() -> None:
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    per_block(model, fully_shard)

    def step(index: int) -> None:
        backward((ref, model), feature_batch(index, 2 * world), mse_loss)
        whole_pairs(model, ref, grads=True)  # a frozen parameter gets no gradient, on both
        for m in (ref, model):
            torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1).step()
            m.zero_grad()
        for fqn, p in model.named_parameters():
            assert isinstance(p, DTensor), fqn
        assert_close_to(model, ref, where=f"after step {index}")

    step(0)
    new_weight = torch.randn(5, 7)  # replace a whole parameter after annotation
    ref.layers[1].weight = nn.Parameter(new_weight.clone())
    model.layers[1].weight = nn.Parameter(new_weight.clone())
    step(1)
    for m in (ref, model):  # freeze one after annotation
        m.layers[0].weight.requires_grad_(False)
    step(2)
    model.layers[2].bias = nn.Parameter(torch.zeros(4))  # a wrong shape is refused
    with pytest.raises(ValueError, match=r"parameter 'bias' was replaced by shape \(4,\); "
                       r"expected shape \(3,\)"):
        mse_loss(model, feature_batch(3, 2))


def test_replace_and_freeze_after_annotation(ranks):
    ranks.run(check_replace_and_freeze_after_annotation, world_size=2)


def check_grad_edits_between_backwards() -> None:
    """Backwards without zero_grad sum into the sharded `.grad`s; clearing one, replacing
    one, or converting them all (module.to, which swaps tensors in place) in between is
    respected, as on the reference."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    per_block(model, fully_shard)

    def backward_and_compare(index: int) -> None:
        x = feature_batch(index, 2 * world).to(ref.layers[0].weight.dtype)
        backward((ref, model), x, mse_loss)
        assert_close_to(model, ref, grads=True, where=f"after {index}")

    backward_and_compare(0)
    backward_and_compare(1)  # summed into the same .grad tensors
    ref.layers[0].weight.grad = None
    model.layers[0].weight.grad = None
    backward_and_compare(2)
    ref.layers[1].bias.grad = ref.layers[1].bias.grad * 2
    model.layers[1].bias.grad = model.layers[1].bias.grad * 2
    backward_and_compare(3)
    for m in (ref, model):
        m.to(torch.float64)
    backward_and_compare(4)
    assert model.layers[0].weight.grad.dtype == torch.float64


def test_grad_edits_between_backwards(ranks):
    ranks.run(check_grad_edits_between_backwards, world_size=2)
