"""A unit whose parameters live on several meshes: shard_placement_fn put some of them on
a mesh of their own (a ShardPlacementResult), e.g. MoE experts sharded over another
data-parallel group than the dense layers. It is one Unit per mesh, each with its own
all-gather and reduce-scatter, gathered, resharded and reduced together: to its hooks it
looks like one Unit."""

from __future__ import annotations

from ._param import ShardedParam
from ._unit import Unit


class MultiMeshUnit:
    """Unit's interface to the hooks, root and FSDPModule, over one Unit per mesh."""

    def __init__(self, parts: list[Unit]) -> None:
        self.parts = parts  # one per mesh, the unit's own mesh first
        first = parts[0]
        self.params: list[ShardedParam] = [p for part in parts for p in part.params]
        self.mesh = first.mesh
        self.device = first.device
        self.streams = first.streams

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
        return all(part.is_unsharded for part in self.parts)

    @property
    def gather_in_flight(self) -> bool:
        return any(part.gather_in_flight for part in self.parts)

    def unshard(self, async_op: bool = False) -> None:
        for part in self.parts:  # every all-gather started before the first is waited for
            part.unshard(async_op=True)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        for part in self.parts:
            part.wait_for_unshard()

    def reshard(self, keep_post_forward: bool = False) -> None:
        for part in self.parts:
            part.reshard(keep_post_forward)

    def reduce_grads(self) -> bool:
        started = [part.reduce_grads() for part in self.parts]  # each part's, in order
        return any(started)

    def finish_reduction(self) -> None:
        for part in self.parts:
            part.finish_reduction()

    def has_unsharded_grads(self) -> bool:
        return any(part.has_unsharded_grads() for part in self.parts)

    def adopt_registered(self) -> None:
        for part in self.parts:
            part.adopt_registered()

    def meta_problem(self) -> str | None:
        return next((m for part in self.parts if (m := part.meta_problem()) is not None), None)

    def shards_replaced(self) -> None:
        for part in self.parts:
            part.shards_replaced()

    def commit_backward(self) -> None:
        for part in self.parts:
            part.commit_backward()

    def discard_backward(self) -> None:
        for part in self.parts:
            part.discard_backward()


AnyUnit = Unit | MultiMeshUnit
