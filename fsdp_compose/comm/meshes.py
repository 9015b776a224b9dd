"""The meshes fully_shard works on, resolved once per unit into a UnitMesh: its groups and
device, and the meshes and groups derived from a user's mesh."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data-parallel: `shard` shards parameters,
    `replicate` replicates them (both: HSDP; alone: DDP-like). torch's class is accepted too."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        """`shard` as a tuple (torch's mesh-info builder, which torchtitan calls, reads it)."""
        return dim_names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return dim_names(self.replicate)


class SpmdDims(NamedTuple):
    """The full SPMD mesh of dp_mesh_dims, and where its data-parallel dims sit."""

    mesh: DeviceMesh
    shard: tuple[int, ...]  # the dims that shard (several: flattened into one), if any
    data_parallel: tuple[int, ...]  # every data-parallel dim (shard and replicate)
    # With several shard dims, the sharded spec's mesh and what each of its dims is: a dim
    # of `mesh` (its index), or the flattened "replicate" or "shard" dim; else None.
    spec: tuple[DeviceMesh, tuple[int | str, ...]] | None


class UnitMesh(NamedTuple):
    """What a unit uses of its mesh: the last dim shards; a leading one (HSDP) replicates."""

    mesh: DeviceMesh
    device: torch.device  # where the unsharded parameters live
    shard_group: ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: ProcessGroup | None
    replicate_size: int
    placements: tuple[Placement, ...]  # a sharded parameter's, on `mesh`
    # None (decided at lazy init) or a bool; for an int, the mesh it reshards to after forward.
    reshard_after_forward: bool | None
    post_forward_mesh: DeviceMesh | None
    spmd: SpmdDims | None = None  # with dp_mesh_dims: the full mesh; `mesh` is its dp part


def unit_mesh(
    mesh: DeviceMesh, reshard_after_forward: bool | int | None, dp_mesh_dims: Any = None,
) -> UnitMesh:
    """Resolve a checked mesh, reshard_after_forward and dp_mesh_dims for one unit."""
    if dp_mesh_dims is not None:
        dp_mesh, spmd = _data_parallel_part(mesh, dp_mesh_dims)
        return unit_mesh(dp_mesh, reshard_after_forward)._replace(spmd=spmd)
    hsdp, shard_dim = mesh.ndim == 2, mesh.ndim - 1  # not -1: Note [mesh dims] in compat.py
    reshard, post_forward = resolve_reshard_after_forward(reshard_after_forward, mesh)
    return UnitMesh(
        mesh=mesh, device=mesh_device(mesh), shard_group=mesh.get_group(shard_dim),
        shard_size=mesh.size(shard_dim), shard_rank=mesh.get_local_rank(shard_dim),
        replicate_group=mesh.get_group(0) if hsdp else None,
        replicate_size=mesh.size(0) if hsdp else 1,
        placements=(Replicate(),) * shard_dim + (Shard(0),),
        reshard_after_forward=reshard, post_forward_mesh=post_forward,
    )


def dim_names(names: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if names is None else (names,) if isinstance(names, str) else tuple(names)


def _data_parallel_part(mesh: DeviceMesh, dims: Any) -> tuple[DeviceMesh, SpmdDims]:
    """The (replicate, shard) or shard mesh a unit communicates over, and its SpmdDims."""
    names = mesh.mesh_dim_names or ()  # named: dp_mesh_dims was checked against them
    shard, replicate = dim_names(dims.shard), dim_names(dims.replicate)
    if not shard:
        dp_mesh = _replicate_only(mesh, replicate)
    elif not replicate:
        dp_mesh = _flat(mesh, shard)
    else:
        dp_mesh = DeviceMesh._concatenate([_flat(mesh, replicate), _flat(mesh, shard)])
    indices = tuple(names.index(n) for n in (*replicate, *shard))
    spec: tuple[DeviceMesh, tuple[int | str, ...]] | None = None
    if len(shard) > 1:  # the mesh torch's fully_shard puts a parameter sharded over several dims on
        parts: list[DeviceMesh] = []
        spec_dims: list[int | str] = []
        for i, name in enumerate(names):
            if name == shard[0]:
                parts.append(dp_mesh)
                spec_dims.extend(("replicate", "shard") if replicate else ("shard",))
            elif name not in shard and name not in replicate:
                parts.append(mesh[name])
                spec_dims.append(i)
        spec = DeviceMesh._concatenate(parts), tuple(spec_dims)
    return dp_mesh, SpmdDims(mesh, indices[len(replicate):], indices, spec)


def _flat(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


def _replicate_only(mesh: DeviceMesh, replicate: tuple[str, ...]) -> DeviceMesh:
    """A (replicate, 1) mesh over `mesh`'s dims `replicate`."""
    # From the whole mesh, which every rank passes alike (Note [derived meshes]).
    def make() -> DeviceMesh:
        names = mesh.mesh_dim_names or ()
        others = [i for i, n in enumerate(names) if n not in replicate]
        order = [*others, *(names.index(n) for n in replicate)]
        ranks = mesh.mesh.permute(order).reshape(*(mesh.size(i) for i in others), -1, 1)
        labels = (*(f"{names[i]}.other" for i in others), "replicate", "shard")
        whole = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=labels)
        return whole["replicate", "shard"]

    return _in_this_world(("replicate only", mesh, replicate), make)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of `mesh`'s shard dim, as torch's fully_shard gives all-gather extensions."""
    if mesh.ndim == 1:
        return mesh
    if mesh.mesh_dim_names is not None:
        return mesh[mesh.mesh_dim_names[-1]]
    group = mesh.get_group(mesh.ndim - 1)
    return _in_this_world(("shard", mesh), lambda: DeviceMesh.from_group(group, mesh.device_type))


def default_mesh(name: str) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group, on the accelerator if any."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"fully_shard({name}): no default process group. Call torch.distributed."
                           "init_process_group() first (torchrun sets up its environment), or "
                           "pass mesh=.")
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if (kind := mesh.device_type) == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


# Note [derived meshes]: building a DeviceMesh creates process groups, which every rank does
# together. Derived meshes and groups are built once per source and cached; every rank
# annotates in the same order, so all hit or miss alike. The cache is per world (default
# process group): a world built anew (tests) resolves no group of the last one.
_derived: weakref.WeakKeyDictionary[ProcessGroup, dict[Hashable, Any]] = weakref.WeakKeyDictionary()


def _in_this_world(key: Hashable, make: Callable[[], T]) -> T:
    cache = _derived.setdefault(dist.group.WORLD, {})  # type: ignore[arg-type]  # set once initialised
    if key not in cache:
        cache[key] = make()
    return cast(T, cache[key])


def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The (replicas, 1) mesh over a 1-D `mesh`'s ranks: HSDP whose shard group is one rank."""
    root = mesh._get_root_mesh()
    names = mesh.mesh_dim_names
    if root is not mesh and names and set(names) <= set(root.mesh_dim_names or ()):
        return _replicate_only(root, names)
    return _in_this_world(("replica", mesh), lambda: DeviceMesh(
        mesh.device_type, mesh.mesh.reshape(-1, 1), mesh_dim_names=("replicate", "shard")
    ))


def post_forward_mesh(mesh: DeviceMesh, group_size: int) -> DeviceMesh:
    """`mesh`'s and its siblings' ranks in rows of `group_size`: dim 1 is the post-forward group."""
    # The ranks of `mesh` and of its siblings in its root (the same on every rank).
    return _in_this_world(("post_forward", mesh, group_size), lambda: DeviceMesh(
        mesh.device_type, mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1, group_size)
    ))


def resolve_reshard_after_forward(
    value: bool | int | None, mesh: DeviceMesh
) -> tuple[bool | None, DeviceMesh | None]:
    """(reshard after forward?, the post-forward mesh if any) for a checked value."""
    if value is None or isinstance(value, bool):
        return value, None
    if value == 1:
        warnings.warn("reshard_after_forward=1 keeps the whole parameters after forward, as False "
                      "does; for freeing them (True) pass a bool.", stacklevel=4)
        return False, None
    if value == mesh.size(mesh.ndim - 1):
        return True, None
    return True, post_forward_mesh(mesh, value)


def separate_group(group: ProcessGroup) -> ProcessGroup:
    """A second process group over `group`'s ranks, created once (a collective among them)."""
    ranks = dist.get_process_group_ranks(group)
    return cast(ProcessGroup, _in_this_world(
        ("separate", tuple(ranks)), lambda: dist.new_group(ranks, use_local_synchronization=True)))
