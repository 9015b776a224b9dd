"""A unit: the parameters one fully_shard call gathers and reduces together, as one part
per mesh they live on (see unit/part.py), each with its Gatherer and Reducer, as FSDP2 keeps
parameter groups; and CommContext, which bounds the collectives units have in flight."""

from __future__ import annotations

from collections import Counter, deque

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..comm.meshes import separate_group
from ..comm.streams import SideStreams
from ..param.codec import AllGatherCodec
from ..param.extension import PRE
from ..param.sharded_param import ShardedParam
from .gather import Gatherer
from .held import GRADIENT_LEDGER
from .part import MeshPart
from .reduce import Reducer
from .settings import UnitSettings


class Unit:
    def __init__(self, parts: list[MeshPart], settings: UnitSettings) -> None:
        self.parts = parts  # one per mesh, the unit's own mesh first
        self.settings = settings  # the parts'
        self.gatherers = [Gatherer(part) for part in parts]
        self.reducers = [Reducer(part) for part in parts]
        first = parts[0]
        self.params: list[ShardedParam] = [p for part in parts for p in part.params]
        self.mesh: DeviceMesh = first.device_mesh
        self.device: torch.device = first.device
        self.streams: SideStreams | None = first.streams

    @property
    def label(self) -> str:
        return self.parts[0].label

    @property
    def fqn_prefix(self) -> str:
        return self.parts[0].fqn_prefix

    def name(self, fqn: str, label: str) -> None:
        """At lazy init: the unit's fqn under its root, for its messages and parameters' fqns."""
        for part in self.parts:
            part.label, part.fqn_prefix = label, f"{fqn}." if fqn else ""

    @property
    def is_unsharded(self) -> bool:
        return all(gatherer.is_unsharded for gatherer in self.gatherers)

    @property
    def gather_in_flight(self) -> bool:
        return any(gatherer.in_flight for gatherer in self.gatherers)

    def unshard(self, async_op: bool = False) -> None:
        for gatherer in self.gatherers:
            gatherer.unshard(async_op=True)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        for gatherer in self.gatherers:
            gatherer.wait_for_unshard()

    def reshard(self, keep_post_forward: bool = False) -> None:
        for gatherer in self.gatherers:
            gatherer.reshard(keep_post_forward)

    def reduce_grads(self) -> bool:
        """Start every part's reduction, in order; whether any had gradients."""
        return any([reducer.reduce_grads() for reducer in self.reducers])  # a list: all run

    def finish_reduction(self) -> None:
        for reducer in self.reducers:
            reducer.finish_reduction()

    def has_unsharded_grads(self) -> bool:
        return any(part.grads.has_unsharded_grads() for part in self.parts)

    def held_by_kind(self) -> dict[str, int]:
        """Bytes held beyond the shards, by kind (the kinds of unit/held.py)."""
        held: Counter[str] = Counter()
        for part, gatherer, reducer in zip(self.parts, self.gatherers, self.reducers):
            held.update(gatherer.held_by_kind())
            held.update(reducer.held_by_kind())
            held[GRADIENT_LEDGER] += part.grads.nbytes()
        return held

    def held_bytes(self) -> int:
        return sum(self.held_by_kind().values())

    def adopt_registered(self) -> None:
        """Once per iteration: a part whose parameters were replaced (see
        ShardedParam.adopt_registered), frozen or unfrozen, gained or lost hooks lays out anew."""
        codecs = self.settings.codecs
        for part in self.parts:
            for p in part.params:
                adopted = p.adopt_registered(part.fqn_prefix)
                hooked = hasattr(p.local, PRE) or p in codecs
                if adopted or hooked is (p.extension is None):  # hooks came or went
                    part.layout = None

    def meta_problem(self) -> str | None:
        return next((m for part in self.parts if (m := part.meta_problem()) is not None), None)

    def shards_replaced(self) -> None:
        """A parameter stored a new shard (materialized, or adopted): the parts lay out anew."""
        for part in self.parts:
            part.layout = None

    def commit_backward(self) -> None:
        """The backward finished: its gradients count. See Note [gradients per backward]."""
        for part in self.parts:
            part.grads.commit()

    def discard_backward(self) -> None:
        """The backward did not finish: forget its gradients, keep the earlier ones."""
        for part, reducer in zip(self.parts, self.reducers):
            reducer.discard()
            part.grads.discard()

    # -- setters whose change reaches beyond UnitSettings ------------------------------------

    def set_post_forward_meshes(self, meshes: list[DeviceMesh | None]) -> None:
        """Reshard each part after forward to dim 1 of its mesh in `meshes`, or fully."""
        for gatherer, mesh in zip(self.gatherers, meshes):
            gatherer.set_post_forward_mesh(mesh)

    def set_codecs(self, codecs: dict[ShardedParam, AllGatherCodec | None]) -> None:
        """Gather each parameter through its codec (None: plainly): the parts lay out anew."""
        new = {**self.settings.codecs, **codecs}
        self.settings.codecs = {p: codec for p, codec in new.items() if codec is not None}
        self.shards_replaced()

    def set_separate_reduce_scatter_group(self, enable: bool) -> None:
        """Reduce-scatter on a group of its own per part (a collective the first time)."""
        self.settings.separate_reduce_scatter_group = enable
        for part in self.parts:
            group = part.mesh.shard_group
            part.use_reduce_group(separate_group(group) if enable else group)


class CommContext:
    """The collectives units have in flight, bounded as each holds buffers until waited for:
    prefetched gathers not yet copied out (a fast CPU thread cannot run the allocator ahead of
    the collectives), reduce-scatters left running while the next unit's backward computes. A
    root's units share one, bounded by the root's settings; roots may (`share_comm_ctx`)."""

    def __init__(self, settings: UnitSettings) -> None:
        self.settings = settings
        # Every rank issues and waits in the same order, as the hooks run in the same order.
        self._gathers: list[Unit] = []  # started asynchronously, oldest first
        self._reductions: deque[Unit] = deque()

    def prefetch(self, unit: Unit) -> None:
        """Start `unit`'s all-gather without waiting; its unshard() finishes it."""
        if unit.is_unsharded or unit.gather_in_flight or not unit.params:
            return
        gathers = self._gathers
        if len(gathers) >= (bound := self.settings.max_all_gathers_in_flight):
            # Gathers finished since (their unit ran) no longer count.
            gathers[:] = [u for u in gathers if u.gather_in_flight]
            while len(gathers) >= bound:
                gathers.pop(0).wait_for_unshard()
        unit.unshard(async_op=True)
        gathers.append(unit)

    def reduce(self, unit: Unit) -> None:
        """Start `unit`'s gradient reduction; `finish_reductions` (or a later one) ends it."""
        while len(self._reductions) >= self.settings.reduce_scatter_max_input_buffers:
            self._reductions.popleft().finish_reduction()
        if unit.reduce_grads():
            self._reductions.append(unit)

    def finish_reductions(self) -> None:
        """Wait for every reduction in flight, oldest first (the end of backward)."""
        while self._reductions:
            self._reductions.popleft().finish_reduction()
