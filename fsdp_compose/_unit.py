"""A unit: the parameters one fully_shard call gathers and reduces together.

It knows nothing of forward or backward (see _hooks.py for when); its jobs are its
parts': gathering (_gather.py), reducing (_reduce.py) and holding gradients between the
two and the sharded `.grad`s (_grad_ledger.py). On a 2-D mesh (replicate, shard) the last
dimension shards and the first replicates.
"""

from __future__ import annotations

import functools

import torch

from ._codec import AllGatherCodec
from ._collectives import CustomComm
from ._extension import PRE
from ._gather import Gatherer
from ._grad_ledger import GradLedger
from ._meshes import UnitMesh
from ._param import ShardedParam
from ._reduce import Reducer
from ._streams import side_streams


class Unit:
    def __init__(self, params: list[ShardedParam], mesh: UnitMesh, label: str) -> None:
        self.params = params
        # For messages: the modules' class names, then (at the first forward) their fqn
        # under the root, which prefixes the parameters' fqns (relative to the unit).
        self.label = label
        self.fqn_prefix = ""
        self.mesh = mesh.mesh
        self.device = mesh.device  # where the unsharded parameters live
        self.streams = side_streams(mesh.device)  # None on the CPU
        self.group = mesh.shard_group
        self.shard_size = mesh.shard_size
        self.replicate_group = mesh.replicate_group
        self.replicate_size = mesh.replicate_size
        self.sizes = [p.layout.padded_shard_numel for p in params]  # per row, padded
        self.shard_numel = sum(self.sizes)  # this rank's padded shards, together
        self.is_complex = False  # whether the collectives send real pairs
        self.mixed_dtypes = False  # whether the parameters gather in different dtypes
        self.all_dim0 = all(p.layout.dim == 0 for p in params)  # see shard_placement_fn
        # Extension points (FSDPModule setters): a user's all-gather, per-parameter codecs.
        self.custom_all_gather: CustomComm | None = None
        self.codecs: dict[ShardedParam, AllGatherCodec] = {}
        self.grads = GradLedger(params, self.sizes)
        self.reducer = Reducer(self, mesh.shard_group)
        self.gatherer = Gatherer(self)
        # The hot steps, bound once: a forwarding method would cost a call each.
        self.unshard = self.gatherer.unshard
        self.wait_for_unshard = self.gatherer.wait_for_unshard
        self.reshard = self.gatherer.reshard
        self.reduce_grads = self.reducer.reduce_grads
        self.finish_reduction = self.reducer.finish_reduction
        self.set_post_forward_mesh = self.gatherer.set_post_forward_mesh
        self.has_unsharded_grads = self.grads.has_unsharded_grads
        if params and not any(p.is_meta for p in params):
            self.gatherer.lay_out(before_gather=False)

    @property
    def parts(self) -> list[Unit]:
        """The units gathered and reduced separately: itself (see MultiMeshUnit)."""
        return [self]

    @property
    def param_dtype(self) -> torch.dtype:
        return self.params[0].param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """What the gradients are reduced in: the widest reduce dtype of the parameters
        that train (a frozen low-precision weight beside them sends no gradient)."""
        training = [p.reduce_dtype for p in self.params if p.sharded.requires_grad]
        return functools.reduce(torch.promote_types, training or [self.params[0].reduce_dtype])

    def held_bytes(self) -> int:
        """Bytes held beyond the shards (unsharded data, communication buffers)."""
        return self.gatherer.held_bytes() + self.reducer.held_bytes()

    @property
    def is_unsharded(self) -> bool:
        return self.gatherer.is_unsharded

    @property
    def gather_in_flight(self) -> bool:
        return self.gatherer.in_flight

    def adopt_registered(self) -> None:
        """Take back parameters changed behind our back (see ShardedParam.adopt_registered)
        and follow parameters frozen or unfrozen since, and all-gather hooks attached to or
        removed from a local shard (see _extension.py). Parameters change between
        iterations: forward calls this once per iteration, not at every gather."""
        for p in self.params:
            if p.adopt_registered(self.fqn_prefix):
                self.shards_replaced()
            elif hasattr(p.local, PRE) is (p.extension is None):  # hooks attached or removed
                self.shards_replaced()

    def meta_problem(self) -> str | None:
        """What is wrong when some parameters are still on the meta device (a local check,
        made before any collective), else None."""
        if not (meta := [p.fqn for p in self.params if p.is_meta]):
            return None
        names = ", ".join(self.fqn_prefix + fqn for fqn in meta)
        return (
            f"fsdp_compose: unit {self.label} on rank {self.mesh.get_rank()}: parameters still "
            f"on the meta device: [{names}]. Initialise them before running forward or "
            "unshard: fsdp_compose.materialize(model), or model.to_empty(device=...) and your "
            "own initialisation."
        )

    def shards_replaced(self) -> None:
        """Some parameter stored a new shard (materialized, or adopted from its module):
        the next gather lays the unit out again."""
        self.gatherer.laid_out = False

    def layout_changed(self) -> None:
        """The gatherer laid the parameters out anew (their dtypes may have changed)."""
        self.is_complex = self.param_dtype.is_complex
        self.mixed_dtypes = len({p.param_dtype for p in self.params}) > 1
        self.reducer.layout_changed()

    def commit_backward(self) -> None:
        """The backward finished: its gradients count. See Note [gradients per backward]."""
        self.grads.commit()

    def discard_backward(self) -> None:
        """The backward did not finish: forget its gradients, keep the earlier ones."""
        self.reducer.discard()
        self.grads.discard()
