"""A unit's parameters on one mesh: what one all-gather and one reduce-scatter move, their
layout, their gradient ledger. Most units are one part; shard_placement_fn may give
parameters a mesh of their own (MoE)."""

from __future__ import annotations

import dataclasses

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..comm.collectives import has_premul_sum
from ..comm.meshes import UnitMesh
from ..comm.streams import SideStreams, side_streams
from ..param.sharded_param import ShardedParam
from .grad_ledger import GradLedger
from .layout import Layout, forms_by_owner, lay_out
from .settings import UnitSettings


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
            self.params, self.mesh, self.sizes, self.label, refuse_unhooked, self.settings.codecs,
            self.settings.custom_all_gather is not None,
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
