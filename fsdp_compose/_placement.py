"""shard_placement_fn: the dim each parameter of a unit is sharded on, resolved and checked
as torch's fully_shard resolves it, before anything changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ._meshes import UnitMesh

ShardPlacementFn = Callable[[nn.Parameter], Any]


def shard_dims(
    name: str, params: list[tuple[str, nn.Parameter]], fn: ShardPlacementFn | None,
    mesh: UnitMesh,
) -> list[int]:
    """Each parameter's shard dim, from 0: what `fn(param)` returns (None: 0; `Shard(dim)`,
    a negative dim counting from the last; a `ShardPlacementResult` on the unit's own mesh),
    checked. Like torch's fully_shard, a dim other than 0 must split evenly over the shard
    ranks (its padding would cost copies around every collective); a tensor-parallel
    parameter is sharded as its local tensor."""
    if fn is None:
        return [0] * len(params)
    return [_shard_dim(name, fqn, param, fn(param), mesh) for fqn, param in params]


def _shard_dim(name: str, fqn: str, param: nn.Parameter, result: object, mesh: UnitMesh) -> int:
    where = f"fully_shard({name}): shard_placement_fn for parameter {fqn!r}"
    if result is not None and not isinstance(result, Shard) and hasattr(result, "mesh_info"):
        result = _on_unit_mesh(where, result, mesh)  # a ShardPlacementResult
    if result is None:
        return 0
    if not isinstance(result, Shard):
        raise ValueError(
            f"{where} returned {result!r}; return Shard(dim), a ShardPlacementResult or None "
            "(dim 0)."
        )
    local = param._local_tensor if isinstance(param, DTensor) else param
    ndim, dim = local.ndim, result.dim
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{where} returned Shard({dim}), out of range for its shape {tuple(local.shape)}."
        )
    dim %= ndim
    if dim != 0 and local.shape[dim] % mesh.shard_size:
        raise NotImplementedError(
            f"{where} returned Shard({result.dim}): its size {local.shape[dim]} on dim {dim} does "
            f"not split evenly over {mesh.shard_size} shard ranks, which torch's fully_shard "
            "refuses too (only dim 0 may split unevenly). Shard it on dim 0 or on an evenly "
            "divisible dim."
        )
    return dim


def _on_unit_mesh(where: str, result: Any, mesh: UnitMesh) -> object:
    """The placement of a ShardPlacementResult whose mesh is the unit's."""
    own_mesh = getattr(result.mesh_info, "mesh", None)
    if own_mesh is not None and own_mesh != mesh.mesh:
        raise NotImplementedError(
            f"{where} returned a ShardPlacementResult on its own mesh {own_mesh}, which "
            f"differs from the unit's {mesh.mesh}; a parameter on another mesh than its "
            "unit's is not supported yet. Annotate it in a fully_shard call of its own."
        )
    placement: object = result.placement
    return placement
