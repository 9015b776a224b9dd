"""A unit's parameters on one mesh: what one all-gather and one reduce-scatter move, their
layout, their gradient ledger; and the unit's settings, one object its parts share. Most
units are one part; shard_placement_fn may give parameters a mesh of their own (MoE)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..comm.collectives import CustomComm, has_premul_sum
from ..comm.meshes import UnitMesh
from ..comm.streams import SideStreams, side_streams
from ..param.sharded_param import ShardedParam
from .codec import AllGatherCodec
from .grad_ledger import GradLedger
from .layout import Layout, forms_by_owner, lay_out


@dataclasses.dataclass
class UnitSettings:
    """What FSDPModule's setters change, the one place each lives (read where used, never
    copied); a change reaching further (layout, post-forward mesh, group) goes through Unit."""

    reshard_after_forward: bool | None  # None: decided at lazy init (False for the root)
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True  # HSDP
    reduce_scatter_unused_params: bool = False
    gradient_divide_factor: float | None = None  # None: the data-parallel ranks
    force_sum_reduction: bool = False
    keep_unsharded_storage: bool = False  # e.g. CUDA graphs
    # Run on each reduced gradient buffer before the final division, on the reduce-scatter
    # stream or on `all_reduce_hook_stream`.
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: torch.Stream | None = None
    custom_all_gather: CustomComm | None = None
    custom_reduce_scatter: CustomComm | None = None
    codecs: dict[ShardedParam, AllGatherCodec] = dataclasses.field(default_factory=dict)


class MeshPart:
    def __init__(
        self, params: list[ShardedParam], mesh: UnitMesh, label: str, settings: UnitSettings
    ) -> None:
        self.params = params
        self.mesh = mesh  # resolved once by fully_shard: groups, sizes, device
        self.device = mesh.device
        self.settings = settings  # the unit's
        # For messages: the modules' class names, then (at the first forward) their fqn
        # under the root, which prefixes the parameters' fqns (relative to the unit).
        self.label, self.fqn_prefix = label, ""
        self.streams: SideStreams | None = side_streams(mesh.device)  # None on the CPU
        self.sizes = [p.layout.padded_shard_numel for p in params]  # per row, padded
        self.all_dim0 = all(p.layout.dim == 0 for p in params)  # see shard_placement_fn
        self.grads = GradLedger(params)
        self.use_reduce_group(mesh.shard_group)
        # None until laid out, and again once a parameter changed: the next gather lays out.
        self.layout: Layout | None = None
        if params and not any(p.is_meta for p in params):
            self.lay_out(refuse_unhooked=False)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh.mesh

    def use_reduce_group(self, group: ProcessGroup) -> None:
        """Reduce-scatter over `group` (the same ranks: a separate group, or the mesh's)."""
        self.reduce_group, self.reduce_premul_sum = group, has_premul_sum(group)

    def lay_out(self, refuse_unhooked: bool = True) -> Layout | None:
        """Lay the parameters out anew (unit/layout.py), refusing parameters still on the meta
        device; the gatherer frees the earlier layout's unsharded data when it sees the new one."""
        if (problem := self.meta_problem()) is not None:
            raise RuntimeError(problem)
        self.layout = lay_out(
            self.params, self.mesh, self.sizes, self.label, refuse_unhooked,
            bool(self.settings.codecs) or self.settings.custom_all_gather is not None,
        )
        return self.layout

    def registrations_changed(self, layout: Layout) -> None:
        """A hook built a new unsharded parameter during a gather over `layout`."""
        if self.layout is layout:
            self.layout = dataclasses.replace(layout, registrations=forms_by_owner(self.params))

    def meta_problem(self) -> str | None:
        """What is wrong if parameters are still on the meta device (a local check), else None."""
        if not (meta := [p.fqn for p in self.params if p.is_meta]):
            return None
        names = ", ".join(self.fqn_prefix + fqn for fqn in meta)
        return (
            f"fsdp_compose: unit {self.label} on rank {self.device_mesh.get_rank()}: parameters "
            f"still on the meta device: [{names}]. Initialise them before running forward or "
            "unshard: fsdp_compose.materialize(model), or model.to_empty(device=...) and your "
            "own initialisation."
        )
