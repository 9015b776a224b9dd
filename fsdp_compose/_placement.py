"""shard_placement_fn: the dim each parameter of a unit is sharded on, and the mesh, resolved
and checked as torch's fully_shard resolves them, before anything changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ._checks import check_reshard_after_forward
from ._meshes import UnitMesh, unit_mesh

ShardPlacementFn = Callable[[nn.Parameter], Any]


def shard_placements(
    name: str, params: list[tuple[str, nn.Parameter, Any]], fn: ShardPlacementFn | None,
    mesh: UnitMesh, reshard_after_forward: bool | int | None,
) -> list[tuple[int, UnitMesh]]:
    """Each parameter's (fqn, parameter, holders) shard dim (from 0) and mesh: what
    `fn(param)` returns (None: dim 0
    on the unit's mesh; `Shard(dim)`, a negative dim counting from the last; a
    `ShardPlacementResult(placement, mesh_info)` whose `mesh_info.mesh` (torch's
    FSDPMeshInfo / HSDPMeshInfo) is a 1-D or a 2-D (replicate, shard) mesh), checked. Like
    torch's fully_shard, a dim other than 0 must split evenly over the shard ranks (its
    padding would cost copies around every collective); a tensor-parallel parameter is
    sharded as its local tensor. Parameters on one mesh share its UnitMesh."""
    if fn is None:
        return [(0, mesh)] * len(params)
    meshes: dict[DeviceMesh, UnitMesh] = {mesh.mesh: mesh}
    placements = []
    for fqn, param, _ in params:
        where = f"fully_shard({name}): shard_placement_fn for parameter {fqn!r}"
        placement, own_mesh = _placement_and_mesh(where, fn(param))
        if own_mesh is not None and own_mesh not in meshes:
            meshes[own_mesh] = _other_mesh(where, own_mesh, mesh, reshard_after_forward)
        resolved = mesh if own_mesh is None else meshes[own_mesh]
        placements.append((_shard_dim(where, param, placement, resolved), resolved))
    return placements


def _placement_and_mesh(where: str, result: object) -> tuple[object, DeviceMesh | None]:
    """The placement, and the mesh of a ShardPlacementResult (None: the unit's)."""
    if result is None or isinstance(result, Shard) or not hasattr(result, "placement"):
        return result, None
    info = getattr(result, "mesh_info", None)
    own_mesh = getattr(info, "mesh", None) if info is not None else getattr(result, "mesh", None)
    if not isinstance(own_mesh, DeviceMesh):
        raise ValueError(f"{where} returned {result!r}, whose mesh_info has no DeviceMesh `mesh`.")
    return result.placement, own_mesh


def _other_mesh(
    where: str, own_mesh: DeviceMesh, mesh: UnitMesh, reshard_after_forward: bool | int | None,
) -> UnitMesh:
    """A parameter's own mesh, resolved like a unit's."""
    if mesh.spmd is not None:
        raise NotImplementedError(
            f"{where} returned a ShardPlacementResult on its own mesh together with "
            "dp_mesh_dims; per-parameter meshes work with a plain data-parallel mesh."
        )
    if own_mesh.ndim not in (1, 2):
        raise ValueError(
            f"{where} returned a ShardPlacementResult on a {own_mesh.ndim}-D mesh; pass a 1-D "
            "(shard) or a 2-D (replicate, shard) mesh."
        )
    check_reshard_after_forward(reshard_after_forward, where, own_mesh.size(-1))
    return unit_mesh(own_mesh, reshard_after_forward)


def _shard_dim(where: str, param: nn.Parameter, placement: object, mesh: UnitMesh) -> int:
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"{where} returned {placement!r}; return Shard(dim), a ShardPlacementResult or "
            "None (dim 0)."
        )
    local = param._local_tensor if isinstance(param, DTensor) else param
    ndim, dim = local.ndim, placement.dim
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{where} returned Shard({dim}), out of range for its shape {tuple(local.shape)}."
        )
    dim %= ndim
    if dim != 0 and local.shape[dim] % mesh.shard_size:
        raise NotImplementedError(
            f"{where} returned Shard({placement.dim}): its size {local.shape[dim]} on dim {dim} "
            f"does not split evenly over {mesh.shard_size} shard ranks, which torch's "
            "fully_shard refuses too (only dim 0 may split unevenly). Shard it on dim 0 or on "
            "an evenly divisible dim."
        )
    return dim
