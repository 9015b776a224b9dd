"""A mesh that leaves out the calling rank is refused at fully_shard, before any collective,
naming the mesh, the rank and the fix; on the mesh's own ranks the same mesh works."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from fsdp_compose import DataParallelMeshDims, fully_shard
from tests.dist.counting import CollectiveCounter
from tests.models import MLP, feature_batch, mse_loss


def _annotate_and_step(mesh: DeviceMesh) -> float:
    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss = mse_loss(model, feature_batch(0, 4))
    loss.backward()
    return loss.item()


def _refusal(**kwargs: object) -> tuple[str, int]:
    """The error fully_shard raises on a rank outside a mesh it gets, and the collectives
    it ran."""
    with CollectiveCounter() as comms, pytest.raises(ValueError) as raised:
        fully_shard(MLP(), **kwargs)
    return str(raised.value), sum(comms.counts.values())


def _own_mesh_for_weights(mesh: DeviceMesh) -> object:
    """A shard_placement_fn putting weights on `mesh` (a mesh info of torch's would fail
    on a rank outside it when built, in torch's own get_group: any object with `mesh`)."""
    info = SimpleNamespace(mesh=mesh)
    return lambda param: (
        SimpleNamespace(placement=Shard(0), mesh_info=info) if param.ndim == 2 else None
    )


def check_mesh_without_this_rank() -> dict[str, object]:
    # Building a mesh may create its groups over the default group: every rank builds each.
    meshes = {
        "1-D": DeviceMesh("cpu", [0], mesh_dim_names=("dp",)),
        "2-D": DeviceMesh("cpu", [[0]], mesh_dim_names=("replicate", "shard")),
    }
    spmd = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "tp"))
    world = init_device_mesh("cpu", (dist.get_world_size(),))
    if dist.get_rank() == 0:  # the mesh's own rank uses it as any one-rank mesh
        return {kind: _annotate_and_step(mesh) for kind, mesh in meshes.items()}
    refused = {kind: _refusal(mesh=mesh) for kind, mesh in meshes.items()}
    refused["dp_mesh_dims"] = _refusal(mesh=spmd, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    refused["shard_placement_fn"] = _refusal(
        mesh=world, shard_placement_fn=_own_mesh_for_weights(meshes["1-D"])
    )
    return refused


def test_mesh_without_this_rank_is_refused_there(ranks):
    on_mesh, outside = ranks.run(check_mesh_without_this_rank, world_size=2)
    assert all(isinstance(loss, float) and loss == loss for loss in on_mesh.values())
    one_d, comms = outside["1-D"]
    assert comms == 0
    assert one_d.startswith("fully_shard(MLP): rank 1 is not in the mesh")
    assert "shape (1,), dims ('dp',), ranks [0]" in one_d
    assert "build the mesh over ranks that include every rank that calls fully_shard" in one_d
    two_d, comms = outside["2-D"]
    assert comms == 0
    assert "shape (1, 1), dims ('replicate', 'shard'), ranks [[0]]" in two_d
    spmd, comms = outside["dp_mesh_dims"]
    assert comms == 0
    assert spmd.startswith("fully_shard(MLP): rank 1 is not in the mesh (shape (1, 1), dims "
                           "('dp', 'tp'), ranks [[0]])")
    own, comms = outside["shard_placement_fn"]
    assert comms == 0
    assert own.startswith("fully_shard(MLP): shard_placement_fn for parameter 'layers.0.weight': "
                          "rank 1 is not in the mesh (shape (1,), dims ('dp',)")
