"""replicate(): data parallelism without sharding (DDP-like), built from fully_shard units."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.meshes import default_mesh, replica_mesh
from ..param.policies import MixedPrecisionPolicy, OffloadPolicy
from .fsdp_module import FSDPModule
from .fully_shard import fully_shard


def replicate(
    module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
) -> FSDPModule | list[FSDPModule]:
    """Ours: keep `module`'s parameters whole on every rank of the 1-D `mesh` and average
    gradients with one all-reduce per unit and backward. An HSDP unit whose shard group is one
    rank, so units of `replicate` and `fully_shard` mix in one model."""
    name = ", ".join(type(m).__name__ for m in (module if isinstance(module, list) else [module]))
    mesh = mesh if mesh is not None else default_mesh(name)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"replicate({name}): pass a 1-D DeviceMesh, got {mesh!r}")
    # Nothing to free after forward: "unsharding" a replicated unit is a local copy.
    return fully_shard(
        module, mesh=replica_mesh(mesh), reshard_after_forward=False, mp_policy=mp_policy,
        offload_policy=offload_policy, ignored_params=ignored_params)

