"""Argument and model checks for fully_shard: all on data every rank has, all before the
first collective and before anything changes, so a failed call leaves the module as it was."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..comm.meshes import SpmdDims, UnitMesh, dim_names
from ..param.policies import MixedPrecisionPolicy, OffloadPolicy
from ..schedule.iteration import state_of

# Marks the sharded parameters fully_shard creates, so a later call on an inner module can
# tell "sharded by an enclosing fully_shard" from a tensor-parallel DTensor.
SHARDED_MARK = "_fsdp_compose_sharded"

Holders = list[tuple[nn.Module, str]]  # every (module, attribute) registering a parameter
Collected = list[tuple[str, nn.Parameter, Holders]]


def check_modules(modules: list[nn.Module]) -> None:
    if not modules:
        raise ValueError("fully_shard needs a module or a non-empty list of modules, got []")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}")
        where = f"fully_shard({type(m).__name__})"
        if state_of(m) is not None:
            raise ValueError(
                f"{where}: this module is already annotated; call fully_shard once per module.")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"{where}: a container without forward is never called, so its "
                             "unit would never gather. Annotate its children, or make them one "
                             "unit: fully_shard(list(container)).")


def check_reshard_after_forward(value: object, where: str, shard_size: int | None) -> None:
    """A bool, None, or an int group size that divides the mesh's shard size."""
    if not isinstance(value, (int, type(None))):
        raise TypeError(f"{where}: reshard_after_forward must be a bool, None or an int group "
                        f"size, got {type(value).__name__} {value!r}")
    if isinstance(value, bool) or value is None or shard_size is None:
        return
    if value < 1 or shard_size % value:
        raise ValueError(f"{where}: reshard_after_forward={value} must divide the mesh's shard "
                         f"size {shard_size} (e.g. the ranks of one host), or be True or False.")


def check_options(name: str, reshard_after_forward: object, shard_placement_fn: object,
                  mp_policy: object, offload_policy: object) -> None:
    where = f"fully_shard({name})"
    check_reshard_after_forward(reshard_after_forward, where, None)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{where}: mp_policy must be a MixedPrecisionPolicy (fsdp_compose's or "
                        f"torch's), got {type(mp_policy).__module__}.{type(mp_policy).__name__}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"{where}: MixedPrecisionPolicy.{field}={dtype!r} is not a floating-point "
                "torch.dtype; use e.g. torch.bfloat16, or None to keep the parameters' dtype.")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"{where}: offload_policy must be an OffloadPolicy or CPUOffloadPolicy "
                        f"(fsdp_compose's or torch's), got {type(offload_policy).__name__}")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"{where}: shard_placement_fn must be a callable (param) -> Shard | "
                        f"ShardPlacementResult | None, got {type(shard_placement_fn).__name__}")


def check_dp_mesh_dims(where: str, mesh: DeviceMesh, dims: object, reshard: object) -> None:
    """dp_mesh_dims names dims of `mesh`, in its order, each to shard or to replicate."""
    where = f"{where}: dp_mesh_dims"
    if not (hasattr(dims, "shard") and hasattr(dims, "replicate")):
        raise TypeError(f"{where} must be a DataParallelMeshDims, got {type(dims).__name__}")
    if (names := mesh.mesh_dim_names) is None:
        raise ValueError(f"{where}: mesh must have mesh_dim_names when dp_mesh_dims is provided")
    shard, replicate = dim_names(dims.shard), dim_names(dims.replicate)
    if unknown := [n for n in (*shard, *replicate) if n not in names]:
        raise ValueError(
            f"{where}: Mesh dim name {unknown[0]!r} not found in mesh.mesh_dim_names {names}")
    for group in (shard, replicate):
        if list(group) != sorted(group, key=names.index):
            raise ValueError(f"{where}: {group} must name mesh dims in the mesh's order {names}.")
    if set(shard) & set(replicate):
        raise ValueError(f"{where}: {dims} names the same mesh dim to shard and to replicate.")
    if isinstance(reshard, int) and not isinstance(reshard, bool):
        raise NotImplementedError(f"{where}: reshard_after_forward as int is not yet supported "
                                  "with SPMD mesh (dp_mesh_dims), as in torch; pass a bool.")


def check_spmd_param(where: str, param: nn.Parameter, spmd: SpmdDims) -> None:
    """With dp_mesh_dims, a DTensor on the full mesh, replicated over the data-parallel dims."""
    if not isinstance(param, DTensor):
        raise ValueError(f"{where}: When dp_mesh_dims is provided, all parameters must be "
                         "DTensors on the full SPMD mesh (e.g. via distribute_module).")
    if param.device_mesh != spmd.mesh:
        raise ValueError(f"{where} is a DTensor on {param.device_mesh}; with dp_mesh_dims it "
                         f"must be on the same mesh passed to fully_shard, {spmd.mesh}.")
    names = spmd.mesh.mesh_dim_names or ()
    for i in spmd.data_parallel:
        if not param.placements[i].is_replicate():
            raise ValueError(f"{where}: Expected Replicate() on data-parallel mesh dim "
                             f"{names[i]!r} (index {i}) but got {param.placements[i]}.")


def check_mesh(where: str, mesh: object, dp_mesh_dims: object, reshard: object) -> None:
    """fully_shard's mesh, or one shard_placement_fn returned: this rank's, on a device here."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    # Refuse a mesh without this rank: torch would fail later with a bare IndexError, or a
    # collective would wait for ranks that never come.
    if mesh.get_coordinate() is None:
        ranks = mesh.mesh  # listed when few, else counted
        listed = ranks.tolist() if ranks.numel() <= 16 else (
            f"{ranks.numel()} from {int(ranks.min())} to {int(ranks.max())}")
        raise ValueError(
            f"{where}: rank {dist.get_rank()} is not in the mesh (shape {tuple(mesh.shape)}, dims "
            f"{mesh.mesh_dim_names or 'unnamed'}, ranks {listed}): build the mesh over ranks that "
            "include every rank that calls fully_shard with it, or call it only on those ranks.")
    if dp_mesh_dims is not None:
        check_dp_mesh_dims(where, mesh, dp_mesh_dims, reshard)
    is_available = getattr(getattr(torch, mesh.device_type, None), "is_available", None)
    if mesh.device_type != "cpu" and not (callable(is_available) and is_available()):
        raise ValueError(
            f"{where}: the mesh is on device type {mesh.device_type!r}, which this torch build or "
            "machine does not have. Build the mesh on \"cpu\" (gloo), or run where it is.")
    if mesh.ndim not in (1, 2) and dp_mesh_dims is None:
        raise ValueError(
            f"{where}: the mesh has {mesh.ndim} dimensions; pass a 1-D mesh (full sharding), a "
            "2-D (replicate, shard) mesh (HSDP), or name its data-parallel dims in dp_mesh_dims.")
    if mesh.ndim == 2 and dp_mesh_dims is None and mesh.size(1) == 1 < mesh.size(0):
        names = mesh.mesh_dim_names or ("0", "1")
        warnings.warn(
            f"{where}: the mesh's shard dimension {names[1]!r} has size 1 (shape "
            f"{tuple(mesh.shape)}, dims {names}), so every rank keeps whole parameters (a 2-D "
            f"mesh is HSDP: dim 1 shards). To shard over {names[0]!r}, pass mesh[{names[0]!r}].",
            stacklevel=3)
    check_reshard_after_forward(reshard, where, mesh.size(mesh.ndim - 1))


def unit_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(fqn prefix, module) for `module` and its submodules outside inner units."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None and state_of(child) is None:  # an inner unit's are its own
            yield from unit_modules(child, f"{prefix}{name}.")


def collect_params(modules: list[nn.Module], ignored: set[nn.Parameter]) -> Collected:
    """(fqn, parameter, holders) of the parameters under `modules` no inner unit claimed."""
    found: dict[int, tuple[str, nn.Parameter, Holders]] = {}
    for prefix, module in [pair for m in modules for pair in unit_modules(m)]:
        for attr, param in module._parameters.items():
            if param is not None and param not in ignored:
                found.setdefault(id(param), (prefix + attr, param, []))[2].append((module, attr))
    return list(found.values())


def check_tensor_parallel(where: str, param: DTensor, mesh: DeviceMesh) -> None:
    """A tensor-parallel parameter composes when its mesh and ours are parts of one mesh."""
    tp_mesh = param.device_mesh
    same_root = tp_mesh._get_root_mesh() == mesh._get_root_mesh()
    overlap = set(tp_mesh.mesh_dim_names or ()) & set(mesh.mesh_dim_names or ())
    if tp_mesh is mesh or not same_root or overlap or not tp_mesh.mesh_dim_names:
        raise ValueError(
            f"{where} is a DTensor on mesh {tp_mesh} with {param.placements}, which is not a "
            f"tensor-parallel part of the same device mesh as fully_shard's mesh {mesh}. Build one "
            "mesh with dims ('dp', 'tp'), parallelize on mesh['tp'] and pass mesh=mesh['dp'].")


def refuse_post_forward_tensor_parallel(where: str, fqn: str) -> None:
    """reshard_after_forward=<int> keeps pieces of plain tensors only."""
    raise NotImplementedError(
        f"{where}: reshard_after_forward=<int> is not supported with the tensor-parallel parameter "
        f"{fqn!r}, as in torch; pass reshard_after_forward=True or False for units of DTensors.")


def check_params(name: str, collected: Collected, device: torch.device,
                 meshes: list[UnitMesh]) -> None:
    for (fqn, param, _), mesh in zip(collected, meshes):
        where = f"fully_shard({name}): parameter {fqn!r}"
        if mesh.spmd is not None:
            check_spmd_param(where, param, mesh.spmd)
        elif isinstance(param, DTensor):
            if getattr(param, SHARDED_MARK, False):
                raise ValueError(f"{where} is already sharded by fully_shard on an enclosing "
                                 "module. Annotate bottom-up: inner modules, then parents.")
            check_tensor_parallel(where, param, mesh.mesh)
            if mesh.post_forward_mesh is not None:
                refuse_post_forward_tensor_parallel(f"fully_shard({name})", fqn)
        if param.ndim == 0:
            raise ValueError(f"{where} is a scalar and cannot be sharded on dim 0. Give it "
                             "shape (1,), or pass it in ignored_params to keep it whole.")
        if param.device.type not in (device.type, "cpu", "meta"):
            raise ValueError(f"{where} is on {param.device} but the mesh is on {device.type}. "
                             "Build the mesh on that device type, or move the module first.")
