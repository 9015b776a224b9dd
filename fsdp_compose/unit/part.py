"""A unit's parameters on one mesh: what one all-gather and one reduce-scatter move.

Most units are one part; shard_placement_fn may put some parameters on a mesh of their
own (MoE experts), and each mesh is a part. A part knows nothing of forward or backward
(see schedule/hooks.py for when); its jobs are gathering (gather.py), reducing
(reduce.py) and holding gradients between the two and the sharded `.grad`s
(grad_ledger.py), over the layout of layout.py. On a 2-D mesh (replicate, shard) the last
dimension shards and the first replicates.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..comm.collectives import CustomComm
from ..comm.meshes import UnitMesh
from ..comm.streams import SideStreams, side_streams
from ..param.extension import PRE
from ..param.sharded_param import ShardedParam
from .codec import AllGatherCodec
from .gather import Gatherer
from .grad_ledger import GradLedger
from .held import GRADIENT_LEDGER
from .layout import Layout, lay_out
from .reduce import Reducer


class MeshPart:
    def __init__(self, params: list[ShardedParam], mesh: UnitMesh, label: str) -> None:
        self.params = params
        self.mesh = mesh  # resolved once by fully_shard: groups, sizes, device
        # For messages: the modules' class names, then (at the first forward) their fqn
        # under the root, which prefixes the parameters' fqns (relative to the unit).
        self.label = label
        self.fqn_prefix = ""
        self.streams: SideStreams | None = side_streams(mesh.device)  # None on the CPU
        self.sizes = [p.layout.padded_shard_numel for p in params]  # per row, padded
        self.all_dim0 = all(p.layout.dim == 0 for p in params)  # see shard_placement_fn
        # None until laid out, and again once a parameter changed: the next gather lays out.
        self.layout: Layout | None = None
        # Extension points (FSDPModule setters): a user's all-gather, per-parameter codecs.
        self.custom_all_gather: CustomComm | None = None
        self.codecs: dict[ShardedParam, AllGatherCodec] = {}
        self.grads = GradLedger(params, self.sizes)
        self.reducer = Reducer(self)
        self.gatherer = Gatherer(self)
        if params and not any(p.is_meta for p in params):
            self.lay_out(refuse_unhooked=False)

    @property
    def device(self) -> torch.device:
        return self.mesh.device

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh.mesh

    def lay_out(self, refuse_unhooked: bool = True) -> Layout | None:
        """Lay the parameters out anew (see unit/layout.py); the gatherer's unsharded data is
        then freed. Refuses parameters still on the meta device."""
        if (problem := self.meta_problem()) is not None:
            raise RuntimeError(problem)
        self.layout = lay_out(
            self.params, self.mesh, self.sizes, self.label, refuse_unhooked,
            bool(self.codecs) or self.custom_all_gather is not None,
        )
        self.gatherer.layout_changed()
        return self.layout

    def held_by_kind(self) -> dict[str, int]:
        """Bytes held beyond the shards, by kind: unsharded data, the all-gather's and the
        reduce-scatter's buffers, pieces kept after forward, the gradient ledger."""
        return {**self.gatherer.held_by_kind(), **self.reducer.held_by_kind(),
                GRADIENT_LEDGER: self.grads.nbytes()}

    def adopt_registered(self) -> None:
        """Take back parameters changed behind our back (see ShardedParam.adopt_registered)
        and follow parameters frozen or unfrozen since, and all-gather hooks attached to or
        removed from a local shard (see param/extension.py). Parameters change between
        iterations: forward calls this once per iteration, not at every gather."""
        for p in self.params:
            if p.adopt_registered(self.fqn_prefix):
                self.layout = None
            elif hasattr(p.local, PRE) is (p.extension is None):  # hooks attached or removed
                self.layout = None

    def meta_problem(self) -> str | None:
        """What is wrong when some parameters are still on the meta device (a local check,
        made before any collective), else None."""
        if not (meta := [p.fqn for p in self.params if p.is_meta]):
            return None
        names = ", ".join(self.fqn_prefix + fqn for fqn in meta)
        return (
            f"fsdp_compose: unit {self.label} on rank {self.device_mesh.get_rank()}: parameters "
            f"still on the meta device: [{names}]. Initialise them before running forward or "
            "unshard: fsdp_compose.materialize(model), or model.to_empty(device=...) and your "
            "own initialisation."
        )
