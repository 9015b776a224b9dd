"""Tensor-parallel parameters under fully_shard: a DTensor on a TP mesh, sharded over the
data-parallel mesh as its local tensor."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from ..comm.meshes import SpmdDims

# Note [tensor parallel]: a parameter that tensor parallelism made a DTensor on a TP mesh is
# sharded as its local tensor over the data-parallel mesh. Unsharded, it is the TP DTensor
# again; sharded, a DTensor on the concatenated (dp..., tp) mesh. When TP also shards that
# dim, each dp shard holds slices of a TP shard: _StridedShard(dim, split_factor=TP shards),
# as torch's fully_shard writes it.

_Spec = tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]]


class TensorParallel(NamedTuple):
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    # With dp_mesh_dims: `mesh` is the full SPMD mesh, whose data-parallel dims we shard over.
    spmd: SpmdDims | None = None

    @classmethod
    def of(cls, param: DTensor, spmd: SpmdDims | None = None) -> TensorParallel:
        return cls(param.device_mesh, tuple(param.placements), param.shape, param.stride(), spmd)

    def local(self, tensor: DTensor) -> torch.Tensor:
        """The local tensor of `tensor` in our placements (a gradient may come Partial)."""
        target = self.placements
        if self.spmd is not None:  # keep partial sums over data-parallel dims: we reduce them
            dp = self.spmd.data_parallel
            target = tuple(tensor.placements[i] if i in dp else p for i, p in enumerate(target))
        if tuple(tensor.placements) != target:
            tensor = tensor.redistribute(self.mesh, target)
        return tensor.to_local().detach()

    def slice(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local part of a whole tensor."""
        local_part = compute_local_shape_and_global_offset
        shape, offsets = local_part(self.shape, self.mesh, self.placements)
        return whole[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def sharded_spec(self, dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...], dim: int,
                     ) -> _Spec:
        """The sharded parameter's spec when `dp_mesh` shards the TP-local tensor on `dim`. On the
        full SPMD mesh (`spmd`): each shard dim's Replicate becomes Shard(dim) (_StridedShard when
        mesh dims after it shard `dim` too); several are one flattened dim (SpmdDims.spec)."""
        if (spmd := self.spmd) is None:
            shards = zip(self.mesh.shape, self.placements)
            tp_shards = math.prod(size for size, placement in shards if placement.is_shard(dim))
            if tp_shards > 1:
                dp_placements = (*dp_placements[:-1], _StridedShard(dim, split_factor=tp_shards))
            mesh = DeviceMesh._concatenate([dp_mesh, self.mesh])
            return mesh, (*dp_placements, *self.placements), self.shape, self.stride
        placements = list(self.placements)
        for index in spmd.shard:
            after = range(index + 1, self.mesh.ndim)
            split = math.prod(self.mesh.size(j) for j in after if placements[j].is_shard(dim))
            placements[index] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        if spmd.spec is None:
            return self.mesh, tuple(placements), self.shape, self.stride
        spec_mesh, dims = spmd.spec
        flat = {"replicate": Replicate(), "shard": placements[spmd.shard[0]]}
        spec = tuple(flat[d] if isinstance(d, str) else placements[d] for d in dims)
        return spec_mesh, spec, self.shape, self.stride
