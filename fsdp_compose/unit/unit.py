"""A unit: the parameters one fully_shard call gathers and reduces together, as one part
per mesh they live on (usually one; see unit/part.py), the way FSDP2 keeps a list of parameter
groups. The hooks, the root and FSDPModule see only this; each step loops over the parts,
every part's all-gather started before the first is waited for."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..comm.streams import SideStreams
from ..param.sharded_param import ShardedParam
from .part import MeshPart


class Unit:
    def __init__(self, parts: list[MeshPart]) -> None:
        self.parts = parts  # one per mesh, the unit's own mesh first
        first = parts[0]
        self.params: list[ShardedParam] = [p for part in parts for p in part.params]
        self.mesh: DeviceMesh = first.device_mesh
        self.device: torch.device = first.device
        self.streams: SideStreams | None = first.streams

    @property
    def label(self) -> str:
        return self.parts[0].label

    @label.setter
    def label(self, label: str) -> None:  # the parts' messages name the unit as it does
        for part in self.parts:
            part.label = label

    @property
    def fqn_prefix(self) -> str:
        return self.parts[0].fqn_prefix

    @fqn_prefix.setter
    def fqn_prefix(self, prefix: str) -> None:
        for part in self.parts:
            part.fqn_prefix = prefix

    @property
    def is_unsharded(self) -> bool:
        for part in self.parts:
            if not part.gatherer.is_unsharded:
                return False
        return True

    @property
    def gather_in_flight(self) -> bool:
        for part in self.parts:
            if part.gatherer.in_flight:
                return True
        return False

    def unshard(self, async_op: bool = False) -> None:
        for part in self.parts:
            part.gatherer.unshard(async_op=True)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        for part in self.parts:
            part.gatherer.wait_for_unshard()

    def reshard(self, keep_post_forward: bool = False) -> None:
        for part in self.parts:
            part.gatherer.reshard(keep_post_forward)

    def reduce_grads(self) -> bool:
        """Start every part's reduction, in order; whether any had gradients."""
        started = False
        for part in self.parts:
            started = part.reducer.reduce_grads() or started
        return started

    def finish_reduction(self) -> None:
        for part in self.parts:
            part.reducer.finish_reduction()

    def has_unsharded_grads(self) -> bool:
        for part in self.parts:
            if part.grads.has_unsharded_grads():
                return True
        return False

    def held_by_kind(self) -> dict[str, int]:
        """Bytes held beyond the shards, by kind (see MeshPart.held_by_kind)."""
        held: dict[str, int] = {}
        for part in self.parts:
            for kind, nbytes in part.held_by_kind().items():
                held[kind] = held.get(kind, 0) + nbytes
        return held

    def held_bytes(self) -> int:
        return sum(self.held_by_kind().values())

    def adopt_registered(self) -> None:
        for part in self.parts:
            part.adopt_registered()

    def meta_problem(self) -> str | None:
        return next((m for part in self.parts if (m := part.meta_problem()) is not None), None)

    def shards_replaced(self) -> None:
        """Some parameter stored a new shard (materialized, or adopted from its module):
        the next gather lays the parts out again."""
        for part in self.parts:
            part.layout = None

    def commit_backward(self) -> None:
        """The backward finished: its gradients count. See Note [gradients per backward]."""
        for part in self.parts:
            part.grads.commit()

    def discard_backward(self) -> None:
        """The backward did not finish: forget its gradients, keep the earlier ones."""
        for part in self.parts:
            part.reducer.discard()
            part.grads.discard()
