"""clip_grad_norm_ returns the single-process norm and clips alike, on every kind of mesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fsdp_compose import clip_grad_norm_
from tests.dist.parity import assert_close_to, backward, make_mesh, three_models, two_models
from tests.models import MLP, feature_batch, mse_loss


def check_clip_on_a_1d_mesh() -> None:
    world = dist.get_world_size()
    for norm_type in (2.0, 1.0, float("inf")):
        models = ref, ours, theirs = three_models(MLP)
        backward(models, feature_batch(0, 2 * world), mse_loss)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        our_norm = clip_grad_norm_(ours.parameters(), 0.05, norm_type)
        assert ref_norm > 0.05, "the test must actually clip"
        torch.testing.assert_close(our_norm, ref_norm, msg=str(norm_type))
        if norm_type != float("inf"):  # torch's raises on the empty shards of a 4-way mesh
            their_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05, norm_type)
            torch.testing.assert_close(our_norm, their_norm.full_tensor(), msg=str(norm_type))
        assert_close_to(ours, ref, grads=True, where=norm_type)


def test_clip_on_a_1d_mesh_matches_single_process(ranks):
    ranks.run(check_clip_on_a_1d_mesh, world_size=4)


def check_clip_on_an_hsdp_model() -> None:
    world = dist.get_world_size()
    ref, ours = two_models(MLP, make_mesh((2, world // 2)))
    backward((ref, ours), feature_batch(0, 2 * world), mse_loss)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    torch.testing.assert_close(clip_grad_norm_(ours.parameters(), 0.05), ref_norm)
    assert_close_to(ours, ref, grads=True)


def test_clip_on_an_hsdp_model_matches_single_process(ranks):
    ranks.run(check_clip_on_an_hsdp_model, world_size=4)


def check_clip_across_meshes() -> None:
    """Gradients on a 1-D mesh, an HSDP mesh (Replicate, Shard(0)) and a 2-D (Shard(0),
    Shard(1)) mesh as tensor parallelism makes, plus a plain tensor: one global norm."""
    torch.manual_seed(0)
    full = [torch.randn(6, 5), torch.randn(7, 3), torch.randn(4, 6), torch.randn(3)]
    flat = init_device_mesh("cpu", (4,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    placements = [(flat, [Shard(0)]), (grid, [Replicate(), Shard(0)]), (grid, [Shard(0), Shard(1)])]
    params = []
    for tensor, (mesh, placement) in zip(full, placements):
        param = nn.Parameter(distribute_tensor(torch.zeros_like(tensor), mesh, placement))
        param.grad = distribute_tensor(tensor.clone(), mesh, placement)
        params.append(param)
    plain = nn.Parameter(torch.zeros(3))
    plain.grad = full[3].clone()
    params.append(plain)
    for norm_type in (2.0, 3.0, float("inf")):
        expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in full]), norm_type)
        torch.testing.assert_close(total := clip_grad_norm_(params, 1e9, norm_type), expected)
        assert total.shape == ()
    clip_grad_norm_(params, 1.0)
    clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    torch.testing.assert_close(
        torch.linalg.vector_norm(torch.cat([t.flatten() for t in clipped])), torch.tensor(1.0)
    )


def test_clip_across_hsdp_and_tensor_parallel_meshes(ranks):
    ranks.run(check_clip_across_meshes, world_size=4)


def check_nonfinite_error() -> None:
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([1.0, float("nan")])
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        clip_grad_norm_([param], 1.0, error_if_nonfinite=True)


def test_nonfinite_norm_raises_when_asked(ranks):
    ranks.run(check_nonfinite_error, world_size=2)
