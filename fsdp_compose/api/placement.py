"""shard_placement_fn: the dim each parameter of a unit is sharded on, and the mesh, resolved
and checked as torch's fully_shard resolves them, before anything changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..comm.meshes import UnitMesh, unit_mesh
from .checks import check_mesh

ShardPlacementFn = Callable[[nn.Parameter], Any]


def shard_placements(
    name: str, params: list[tuple[str, nn.Parameter, Any]], fn: ShardPlacementFn | None,
    mesh: UnitMesh, reshard_after_forward: bool | int | None,
) -> list[tuple[int, UnitMesh]]:
    """Each parameter's shard dim and mesh from `fn(param)`, checked: None (dim 0 on the unit's
    mesh), `Shard(dim)`, or a `ShardPlacementResult(placement, mesh_info)`, whose mesh_info has
    a `mesh`, or with dp_mesh_dims a `spmd_mesh` and `dp_mesh_dims`, as in torch."""
    if fn is None:
        return [(0, mesh)] * len(params)
    # Keyed as a ShardPlacementResult's mesh_info names a mesh: (mesh, spmd_mesh).
    unit_key = (mesh.mesh, None if mesh.spmd is None else mesh.spmd.mesh)
    meshes: dict[tuple[DeviceMesh, DeviceMesh | None], UnitMesh] = {unit_key: mesh}
    placements = []
    for fqn, param, _ in params:
        where = f"fully_shard({name}): shard_placement_fn for parameter {fqn!r}"
        placement, resolved = fn(param), mesh
        # A ShardPlacementResult; None and a Shard are on the unit's mesh.
        if hasattr(placement, "placement"):
            info: Any = getattr(placement, "mesh_info", None)
            if not isinstance(getattr(info, "mesh", None), DeviceMesh):
                raise ValueError(
                    f"{where} returned {placement!r}, whose mesh_info has no DeviceMesh `mesh`.")
            key = (info.mesh, getattr(info, "spmd_mesh", None))
            if key not in meshes:
                meshes[key] = _other_mesh(where, info, mesh, reshard_after_forward)
            placement, resolved = placement.placement, meshes[key]
        placements.append((_shard_dim(where, param, placement, resolved), resolved))
    return placements


def _other_mesh(where: str, info: Any, mesh: UnitMesh, reshard: bool | int | None) -> UnitMesh:
    """A parameter's own mesh (MoE experts beside dense parameters), resolved like a unit's."""
    spmd_mesh, dims = getattr(info, "spmd_mesh", None), getattr(info, "dp_mesh_dims", None)
    if (spmd_mesh is None or dims is None) != (mesh.spmd is None):
        raise ValueError(
            f"{where} returned a ShardPlacementResult whose mesh_info "
            f"{'has' if dims is not None else 'has no'} dp_mesh_dims, while the unit is sharded "
            f"with {'a plain data-parallel mesh' if mesh.spmd is None else 'dp_mesh_dims'}: "
            "give mesh infos dp_mesh_dims and the SPMD mesh exactly when fully_shard gets them.")
    own_mesh, dims = (info.mesh, None) if mesh.spmd is None else (info.spmd_mesh, dims)
    check_mesh(where, own_mesh, dims, reshard)
    return unit_mesh(own_mesh, reshard, dims)


def _shard_dim(where: str, param: nn.Parameter, placement: object, mesh: UnitMesh) -> int:
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(f"{where} returned {placement!r}; return Shard(dim), a "
                         "ShardPlacementResult or None (dim 0).")
    local = param._local_tensor if isinstance(param, DTensor) else param
    ndim, dim = local.ndim, placement.dim
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{where} returned Shard({dim}), out of range for its shape {tuple(local.shape)}.")
    dim %= ndim
    if dim != 0 and local.shape[dim] % mesh.shard_size:
        raise NotImplementedError(
            f"{where} returned Shard({placement.dim}): its size {local.shape[dim]} on dim {dim} "
            f"does not split evenly over {mesh.shard_size} shard ranks, which torch's "
            "fully_shard refuses too (only dim 0 may split unevenly). Shard it on dim 0 or on "
            "an evenly divisible dim.")
    return dim
