"""Mixture of experts on a full SPMD mesh, as torchtitan's `full_dtensor` backend builds it:
every parameter a DTensor, dense ones on (dp_shard, tp), routed experts on (efsdp, ep) and
sharded over ep; `fully_shard` gets `dp_mesh_dims` for the dense mesh, and
`shard_placement_fn` puts the experts on theirs with a `ShardPlacementResult` built by
torch's own mesh-info builder. Trains bit for bit as torch's fully_shard, at 2 ranks (ep 2)
and 4 ranks (efsdp 2 x ep 2, experts sharded on dim 0 or 1), with torch's placements; its
checkpoints load at another layout."""

from __future__ import annotations

import copy
import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from fsdp_compose import DataParallelMeshDims, FSDPModule, fully_shard
from tests.dist.parity import max_diff, optimizer_step, spmd_diffs

try:  # the setup is built with torch's own DataParallelMeshDims and ShardPlacementResult
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:
    pytest.skip(
        "torch's fully_shard has no DataParallelMeshDims or ShardPlacementResult before "
        "torch 2.13", allow_module_level=True,
    )

EXPERTS, TOP_K, DIM, HIDDEN = 4, 2, 8, 6


class GroupedExperts(nn.Module):
    """All routed experts' weights stacked (E, F, D), as torchtitan's grouped experts.
    Expert parallel when they are DTensors sharded over "ep": every ep rank's tokens go
    to every ep rank, each computes its own experts for all of them, and the outputs are
    summed back to the tokens' ranks (an all-gather and a reduce-scatter in place of
    torchtitan's all-to-alls)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * DIM**-0.5)
        self.w2_EDF = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * HIDDEN**-0.5)

    def compute(self, x: torch.Tensor, gates: torch.Tensor, w1, w2) -> torch.Tensor:
        h = torch.einsum("td,efd->etf", x, w1).relu()
        return torch.einsum("etd,te->td", torch.einsum("etf,edf->etd", h, w2), gates)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.w1_EFD, DTensor):
            return self.compute(x, gates, self.w1_EFD, self.w2_EDF)
        mesh = self.w1_EFD.device_mesh  # ([dp_replicate,] efsdp, ep)
        others = [Replicate()] * (mesh.ndim - 1)
        tokens, all_gates = (
            DTensor.from_local(t, mesh, [*others, Shard(0)])
            .redistribute(mesh, [*others, Replicate()])
            .to_local(grad_placements=[*others, Partial()])
            for t in (x, gates)
        )
        ep, index = mesh.size(-1), mesh.get_local_rank(mesh.ndim - 1)
        mine = all_gates.chunk(ep, dim=1)[index]  # the gates of this rank's experts
        weights = [w.to_local() for w in (self.w1_EFD, self.w2_EDF)]
        for w in weights:  # summed over ep ranks' tokens; fully_shard averages over efsdp
            w.register_hook(lambda grad: grad / ep)
        partial = self.compute(tokens, mine, *weights)
        summed = DTensor.from_local(partial, mesh, [*others, Partial()])
        return summed.redistribute(mesh, [*others, Shard(0)]).to_local()


class MoEBlock(nn.Module):
    """A norm and a projection, a router, routed experts (top-k) and a shared expert."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.routed_experts = GroupedExperts()
        self.shared_expert = nn.Sequential(
            nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(self.norm(x))
        scores = self.router(h).softmax(dim=-1)
        local_h, local_scores = (t.to_local() if isinstance(t, DTensor) else t for t in (h, scores))
        top, index = local_scores.topk(TOP_K, dim=-1)
        gates = torch.zeros_like(local_scores).scatter(1, index, top)
        routed = self.routed_experts(local_h, gates)
        if isinstance(h, DTensor):
            routed = DTensor.from_local(routed, h.device_mesh, h.placements)
        return h + self.shared_expert(h) + routed


class MoEModel(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock() for _ in range(depth))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@functools.cache
def spmd_meshes(ep: int, replicas: int = 1) -> tuple[DeviceMesh, DeviceMesh]:
    """torchtitan's ParallelDims: one world mesh, unflattened into the dense storage mesh
    ([dp_replicate,] dp_shard, tp) and the sparse one ([dp_replicate,] efsdp, ep). Built
    once per process, as a trainer does: torch's fully_shard wants a parameter's mesh to
    be the very mesh object of its mesh info, and DTensor may hand back an equal mesh
    built earlier."""
    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    shards = dist.get_world_size() // replicas
    hsdp = ("dp_replicate",) if replicas > 1 else ()
    lead = (replicas,) if replicas > 1 else ()
    dense = world._unflatten(0, (*lead, shards, 1), (*hsdp, "dp_shard", "tp"))
    sparse = world._unflatten(0, (*lead, shards // ep, ep), (*hsdp, "efsdp", "ep"))
    return dense, sparse


def dp_dims(mesh: DeviceMesh, dims_cls, shard: str):
    """The data-parallel dims of `mesh` as torchtitan names them."""
    replicate = "dp_replicate" if "dp_replicate" in mesh.mesh_dim_names else None
    return dims_cls(shard=shard, replicate=replicate)


def on_meshes(model: nn.Module, dense: DeviceMesh, sparse: DeviceMesh) -> nn.Module:
    """Every parameter a DTensor: experts sharded over ep, the rest replicated."""
    model = copy.deepcopy(model)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if isinstance(module, GroupedExperts):
                placements = [*[Replicate()] * (sparse.ndim - 1), Shard(0)]
                value = distribute_tensor(p.detach(), sparse, placements)
            else:
                value = distribute_tensor(p.detach(), dense, [Replicate()] * dense.ndim)
            setattr(module, name, nn.Parameter(value))
    return model


def annotate(model, shard_fn, dims_cls, dense, sparse, expert_dim: int) -> None:
    """torchtitan's apply_fsdp_to_decoder with ep > 1: each block a unit whose experts go to
    the sparse mesh (its dims reach fully_shard through the mesh info), the root on the
    dense mesh."""
    dense_dims = dp_dims(dense, dims_cls, "dp_shard")
    # torch's own mesh-info builder, given the dims class of the fully_shard it builds for
    # (torchtitan passes whichever DataParallelMeshDims its fully_shard takes).
    dense_info = _get_mesh_info(dense, dp_dims(dense, dims_cls, "dp_shard"))
    sparse_info = _get_mesh_info(sparse, dp_dims(sparse, dims_cls, "efsdp"))
    for layer in model.layers:
        experts = set(layer.routed_experts.parameters())

        def placement(param, experts=experts):
            if param in experts:
                return ShardPlacementResult(placement=Shard(expert_dim), mesh_info=sparse_info)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)

        shard_fn(layer, mesh=dense, dp_mesh_dims=dense_dims, shard_placement_fn=placement)
    shard_fn(model, mesh=dense, dp_mesh_dims=dense_dims)


def batch(step: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(100 + step)
    return torch.randn(4 * ranks, DIM), torch.randn(4 * ranks, 3)


def check_moe_trains_like_torch(ep: int, expert_dim: int, replicas: int) -> dict[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    dense, sparse = spmd_meshes(ep, replicas)
    torch.manual_seed(0)
    ref = MoEModel()
    ours, theirs = on_meshes(ref, dense, sparse), on_meshes(ref, dense, sparse)
    annotate(ours, fully_shard, DataParallelMeshDims, dense, sparse, expert_dim)
    annotate(theirs, torch_fully_shard, TorchDataParallelMeshDims, dense, sparse, expert_dim)
    placements = {
        fqn: [(t.placements, t.device_mesh.shape, t.device_mesh.mesh_dim_names) for t in (p, q)]
        for (fqn, p), q in zip(ours.named_parameters(), theirs.parameters())
    }
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours, theirs)]
    input_placements = [*[Shard(0)] * (dense.ndim - 1), Replicate()]  # rank r: chunk r
    vs_torch = vs_ref = 0.0
    for step in range(3):
        x, target = batch(step, world)
        F.mse_loss(ref(x), target).backward()
        losses = []
        for model in (ours, theirs):
            local = DTensor.from_local(x.chunk(world)[rank], dense, input_placements)
            out = model(local).to_local()
            losses.append(F.mse_loss(out, target.chunk(world)[rank]))
            losses[-1].backward()
        vs_torch = max(vs_torch, max_diff(*losses))
        grads = spmd_diffs(ours, theirs, ref, grads=True)
        optimizer_step(optims)
        params = spmd_diffs(ours, theirs, ref)
        vs_torch = max(vs_torch, grads[0], params[0])
        vs_ref = max(vs_ref, grads[1], params[1])
    return {"vs_torch": vs_torch, "vs_ref": vs_ref, "placements": placements}


@pytest.mark.parametrize(
    "world_size, ep, expert_dim, replicas",
    [(2, 2, 0, 1), (4, 2, 0, 1), (4, 2, 1, 1), (4, 2, 0, 2)],
    ids=["efsdp 1 x ep 2", "efsdp 2 x ep 2", "efsdp 2 x ep 2, experts on dim 1",
         "HSDP: 2 replicas of efsdp 1 x ep 2"],
)
def test_moe_on_a_full_spmd_mesh_trains_like_torch(ranks, world_size, ep, expert_dim, replicas):
    for result in ranks.run(check_moe_trains_like_torch, world_size=world_size, ep=ep,
                            expert_dim=expert_dim, replicas=replicas):
        assert result["vs_torch"] == 0.0, result
        assert result["vs_ref"] < 1e-5, result
        for fqn, (ours, theirs) in result["placements"].items():
            assert ours == theirs, (fqn, ours, theirs)
        experts = result["placements"]["layers.0.routed_experts.w1_EFD"][0]
        assert experts[2][-2:] == ("efsdp", "ep")  # the experts stay on their own mesh


def check_checkpoint_at_another_layout(folder: str) -> float:
    """Saved with ep 2 x efsdp 2 (torch.distributed.checkpoint), loaded with ep 1 x
    efsdp 4: the whole tensors are equal."""
    torch.manual_seed(0)
    ref = MoEModel()
    models = []
    for ep in (2, 1):
        dense, sparse = spmd_meshes(ep)
        model = on_meshes(ref if ep == 2 else MoEModel(), dense, sparse)
        annotate(model, fully_shard, DataParallelMeshDims, dense, sparse, expert_dim=0)
        models.append(model)
    saved, loaded = models
    dcp.save(saved.state_dict(), checkpoint_id=folder)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=folder)
    loaded.load_state_dict(state)
    return max(max_diff(p.full_tensor(), q.full_tensor())
               for p, q in zip(saved.parameters(), loaded.parameters()))


def test_moe_checkpoint_loads_at_another_layout(ranks):
    with tempfile.TemporaryDirectory() as folder:
        errors = ranks.run(check_checkpoint_at_another_layout, world_size=4,
                           folder=os.path.join(folder, "ckpt"))
    assert errors == [0.0] * 4


def check_mesh_infos_must_match_the_unit() -> list[tuple[str, str]]:
    """A unit sharded with dp_mesh_dims whose shard_placement_fn hands a mesh info built
    without them (or the other way round) is refused before anything changes."""
    dense, sparse = spmd_meshes(2)
    torch.manual_seed(0)
    messages = []
    for with_dims in (True, False):
        model = on_meshes(MoEModel(depth=1), dense, sparse)
        layer = model.layers[0]
        experts = set(layer.routed_experts.parameters())
        plain = _get_mesh_info(sparse["efsdp"])
        spmd = _get_mesh_info(sparse, TorchDataParallelMeshDims(shard="efsdp"))
        info = plain if with_dims else spmd

        def placement(param, experts=experts, info=info):
            return ShardPlacementResult(Shard(0), info) if param in experts else None

        kwargs = {"dp_mesh_dims": DataParallelMeshDims(shard="dp_shard")} if with_dims else {}
        try:
            fully_shard(layer, mesh=dense if with_dims else dense["dp_shard"],
                        shard_placement_fn=placement, **kwargs)
        except ValueError as error:
            messages.append(("ValueError", str(error)))
        assert not isinstance(layer, FSDPModule)  # untouched
    return messages


def test_mesh_infos_must_match_the_unit(ranks):
    results = ranks.run(check_mesh_infos_must_match_the_unit, world_size=2)
    assert results[0] == results[1] and len(results[0]) == 2  # every rank alike
    with_dims, without = (message for _, message in results[0])
    assert "mesh_info has no dp_mesh_dims, while the unit is sharded with dp_mesh_dims" in with_dims
    assert (
        "mesh_info has dp_mesh_dims, while the unit is sharded with a plain data-parallel mesh"
        in without
    )
