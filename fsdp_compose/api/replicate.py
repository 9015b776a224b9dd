"""replicate(): data parallelism without sharding (DDP-like), built from fully_shard units."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.meshes import default_mesh, replica_mesh
from ..param.policies import MixedPrecisionPolicy, OffloadPolicy
from .fsdp_module import FSDPModule
from .fully_shard import fully_shard


def replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
) -> FSDPModule | list[FSDPModule]:
    """Keep `module`'s parameters whole on every rank of the 1-D `mesh`; average gradients
    with one all-reduce per unit and backward. Ours: torch's fully_shard API has no replicate().

    A unit of HSDP whose shard group is one rank: the same hooks and FSDPModule methods,
    no parameter gathers. Units made by `replicate` and by `fully_shard` mix in one model.
    """
    name = ", ".join(type(m).__name__ for m in (module if isinstance(module, list) else [module]))
    mesh = mesh if mesh is not None else default_mesh(name)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"replicate({name}): pass a 1-D DeviceMesh, got {mesh!r}")
    kwargs: dict[str, Any] = {"mp_policy": mp_policy, "offload_policy": offload_policy}
    # Nothing to free after forward: "unsharding" a replicated unit is a local copy.
    return fully_shard(module, mesh=replica_mesh(mesh), reshard_after_forward=False,
                       ignored_params=ignored_params, **kwargs)

