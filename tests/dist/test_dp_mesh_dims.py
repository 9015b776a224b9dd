"""dp_mesh_dims: a full SPMD mesh whose parameters are DTensors on it (tensor parallel on
"tp", replicated on the data-parallel dims) trains, on 4 gloo ranks, bit for bit as under
torch's fully_shard with the same DataParallelMeshDims, and as a single-process model on all
ranks' data: full sharding, HSDP and replicate-only, gradient clipping included. Sharded
placements are torch's. (On a torch whose fully_shard has no dp_mesh_dims, ours is compared
with the single-process model only.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_compose import DataParallelMeshDims, clip_grad_norm_, fully_shard
from tests.dist.parity import full, max_diff, optimizer_step, spmd_diffs

try:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
except ImportError:  # an older torch's fully_shard: dp_mesh_dims is ours alone there
    TorchDataParallelMeshDims = None

SETUPS = {
    # name: mesh shape, mesh dim names, shard dim, replicate dim
    "full sharding": ((2, 2), ("dp_shard", "tp"), "dp_shard", None),
    "HSDP": ((2, 2, 1), ("dp_replicate", "dp_shard", "tp"), "dp_shard", "dp_replicate"),
    "replicate only": ((2, 2), ("dp_replicate", "tp"), None, "dp_replicate"),
    # Several names: flattened into one data-parallel dim.
    "flattened shard": ((2, 2, 1), ("dp_shard", "cp", "tp"), ("dp_shard", "cp"), None),
    "flattened shard, HSDP": (
        (1, 2, 2, 1), ("dp_replicate", "dp_shard", "cp", "tp"), ("dp_shard", "cp"), "dp_replicate",
    ),
    "flattened replicate": ((2, 2, 1), ("ddp1", "ddp2", "tp"), None, ("ddp1", "ddp2")),
}
# Tensor parallel on the last ("tp") dim: fc1 column-wise, fc2 row-wise.
TP_PLACEMENTS = {
    "fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1), "fc2.bias": Replicate()
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def on_mesh(model: nn.Module, mesh) -> nn.Module:
    """Every parameter a DTensor on the whole mesh: TP on "tp", replicated elsewhere."""
    model = copy.deepcopy(model)
    for fqn, p in list(model.named_parameters()):
        owner, name = model.get_submodule(fqn.rsplit(".", 1)[0]), fqn.rsplit(".", 1)[1]
        placements = [Replicate()] * (mesh.ndim - 1) + [TP_PLACEMENTS[fqn]]
        setattr(owner, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return model


def check_trains_like_torch(setup: str) -> dict[str, object]:
    shape, names, shard, replicate = SETUPS[setup]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_names = {
        n for group in (shard, replicate) if group
        for n in ((group,) if isinstance(group, str) else group)
    }
    dp = [i for i, n in enumerate(names) if n in dp_names]
    torch.manual_seed(0)
    ref = MLP()
    ours, theirs = on_mesh(ref, mesh), on_mesh(ref, mesh)
    # Without torch's dp_mesh_dims, the second model is ours again: vs_torch is then 0 by
    # construction, and vs_ref (the single-process model) is the check that remains.
    their_shard, their_dims = (
        (torch_fully_shard, TorchDataParallelMeshDims) if TorchDataParallelMeshDims
        else (fully_shard, DataParallelMeshDims)
    )
    for model, shard_fn, dims in (
        (ours, fully_shard, DataParallelMeshDims(shard=shard, replicate=replicate)),
        (theirs, their_shard, their_dims(shard=shard, replicate=replicate)),
    ):
        shard_fn(model.fc1, mesh=mesh, dp_mesh_dims=dims)
        shard_fn(model, mesh=mesh, dp_mesh_dims=dims)
    placements = {  # and the mesh each sharded parameter is on
        fqn: [(t.placements, t.device_mesh.shape, t.device_mesh.mesh_dim_names) for t in (p, q)]
        for (fqn, p), q in zip(ours.named_parameters(), theirs.parameters())
    }
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours, theirs)]
    # This rank's share of the batch: its coordinate over the data-parallel dims.
    coordinate = mesh.get_coordinate()
    share, shares = 0, 1
    for i in dp:
        share, shares = share * shape[i] + coordinate[i], shares * shape[i]
    input_placements = [Shard(0) if i in dp else Replicate() for i in range(len(shape))]
    vs_torch = vs_ref = norm_diff = 0.0
    for step in range(3):
        torch.manual_seed(10 + step)
        x, target = torch.randn(4 * shares, 8), torch.randn(4 * shares, 4)
        ref_loss = F.mse_loss(ref(x), target)
        ref_loss.backward()
        losses = []
        for model in (ours, theirs):
            local = DTensor.from_local(x.chunk(shares)[share], mesh, input_placements)
            out = model(local).redistribute(mesh, input_placements).to_local()
            losses.append(F.mse_loss(out, target.chunk(shares)[share]))
            losses[-1].backward()
        vs_torch = max(vs_torch, max_diff(*losses))
        grads = spmd_diffs(ours, theirs, ref, grads=True)
        # The norm across the 2-D placements sums in another order than torch's (an ulp
        # apart); max_norm above it keeps the step exact.
        norms = [
            clip_grad_norm_(ours.parameters(), 1e3),
            nn.utils.clip_grad_norm_(theirs.parameters(), 1e3),
        ]
        norm_diff = max(norm_diff, abs(full(norms[0]).item() / full(norms[1]).item() - 1))
        optimizer_step(optims)
        params = spmd_diffs(ours, theirs, ref)
        vs_torch = max(vs_torch, grads[0], params[0])
        vs_ref = max(vs_ref, grads[1], params[1])
    return {
        "vs_torch": vs_torch, "vs_ref": vs_ref, "norm_diff": norm_diff, "placements": placements
    }


@pytest.mark.parametrize("setup", list(SETUPS))
def test_trains_like_torch_fully_shard(ranks, setup):
    for result in ranks.run(check_trains_like_torch, setup=setup, world_size=4):
        assert result["vs_torch"] == 0.0, result
        assert result["vs_ref"] < 1e-5, result
        assert result["norm_diff"] < 1e-6, result
        for fqn, (ours, theirs) in result["placements"].items():
            assert ours == theirs, (fqn, ours, theirs)


def check_refusals() -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    messages = []
    for model, dims, kwargs in (
        (MLP(), DataParallelMeshDims(shard="dp_shard"), {}),  # plain parameters
        (on_mesh(MLP(), mesh), DataParallelMeshDims(shard="dp"), {}),  # no such dim
        (
            on_mesh(MLP(), mesh), DataParallelMeshDims(shard="dp_shard"),
            {"reshard_after_forward": 2},
        ),
    ):
        with pytest.raises((ValueError, NotImplementedError)) as raised:
            fully_shard(model, mesh=mesh, dp_mesh_dims=dims, **kwargs)
        messages.append(str(raised.value))
    with pytest.raises(ValueError, match="At least one"):
        DataParallelMeshDims()
    return messages


def test_refusals_name_the_problem(ranks):
    plain, unknown, int_reshard = ranks.run(check_refusals, world_size=4)[0]
    assert "'fc1.weight'" in plain and "must be DTensors" in plain
    assert "'dp' not found" in unknown
    assert "reshard_after_forward as int" in int_reshard
