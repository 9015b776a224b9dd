"""Tensor-parallel parameters under fully_shard: a DTensor on a TP mesh, sharded over the
data-parallel mesh as its local tensor."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# Note [tensor parallel]: a parameter that tensor parallelism made a DTensor on a TP mesh
# is sharded here as its local tensor: rows of the TP-local tensor over the data-parallel
# mesh (or slices on the dim shard_placement_fn names). Unsharded, it is the TP DTensor again (the all-gather rebuilds its local tensor);
# sharded, a DTensor on the concatenated (dp..., tp) mesh. When TP also shards that dim,
# each dp shard holds slices of a TP shard, a layout DTensor names _StridedShard(dim,
# split_factor=TP shards), as torch's fully_shard does.


class TensorParallel(NamedTuple):
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, param: DTensor) -> TensorParallel:
        return cls(param.device_mesh, tuple(param.placements), param.shape, param.stride())

    def local(self, tensor: DTensor) -> torch.Tensor:
        """The local tensor of `tensor` in our placements (a gradient may come Partial)."""
        if tuple(tensor.placements) != self.placements:
            tensor = tensor.redistribute(self.mesh, self.placements)
        return tensor.to_local().detach()

    def slice(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local part of a whole tensor."""
        local_shape, offsets = compute_local_shape_and_global_offset(
            self.shape, self.mesh, self.placements
        )
        index = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
        return whole[index]

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def sharded_spec(
        self, dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...], dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]]:
        """The sharded parameter's DTensor spec when the data-parallel mesh shards the
        TP-local tensor on `dim`."""
        tp_shards = 1
        for size, placement in zip(self.mesh.shape, self.placements):
            if placement.is_shard(dim):
                tp_shards *= size
        if tp_shards > 1:
            dp_placements = (*dp_placements[:-1], _StridedShard(dim, split_factor=tp_shards))
        mesh = DeviceMesh._concatenate([dp_mesh, self.mesh])
        return mesh, (*dp_placements, *self.placements), self.shape, self.stride
