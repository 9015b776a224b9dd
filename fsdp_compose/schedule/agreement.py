"""The first forward's check that every rank built the same model: once, cheaply, and raised
on every rank alike, instead of a hang or a size mismatch inside the first all-gather."""

from __future__ import annotations

import hashlib
from typing import cast

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..comm.collectives import all_gather_object, collective_failed
from ..unit.unit import Unit

# One rank's view: (label, digest of its parameters) per unit, and its local problem.
_RankView = tuple[list[tuple[str, str]], str | None]


def check_ranks_agree(units: list[Unit], mesh: DeviceMesh, problem: str | None) -> None:
    """Raise on every rank of `mesh` if any rank has a `problem` (a local check's message)
    or if the ranks' units differ in names, shapes or dtypes of their parameters."""
    digests = [(u.label, hashlib.sha1("\n".join(_describe(u)).encode()).hexdigest()) for u in units]
    local: _RankView = (digests, problem)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if group.size() == 1:
            continue
        try:
            gathered = cast(list[_RankView], all_gather_object(local, group))
        except RuntimeError as error:
            if problem is not None:  # what this rank found matters more than the wait
                raise RuntimeError(
                    f"{problem}\n(Found on this rank before the first forward's model check "
                    f"with the other ranks, which then failed too: {error})"
                ) from error
            check = "model check of the first forward"
            raise collective_failed(units[0].label, check, group.size(), error) from error
        if (rank_problem := next((p for _, p in gathered if p is not None), None)) is not None:
            raise RuntimeError(rank_problem)
        for index, (described, _) in enumerate(gathered[1:], start=1):
            if described != gathered[0][0]:
                _raise_difference(units, gathered[0][0], described, group, index)


def _describe(unit: Unit) -> list[str]:
    return [f"{p.fqn} {tuple(p.shape)} {p.sharded.dtype}" for p in unit.params]


def _raise_difference(
    units: list[Unit], first: list[tuple[str, str]], other: list[tuple[str, str]],
    group: dist.ProcessGroup, index: int,
) -> None:
    at = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
    # Every rank takes part in this second gather, so every rank raises the same error.
    described = all_gather_object(_describe(units[at]) if at < len(units) else None, group)
    ranks = dist.get_global_rank(group, 0), dist.get_global_rank(group, index)
    label = first[at][0] if at < len(first) else other[at][0]
    raise RuntimeError(
        f"fsdp_compose: ranks {ranks[0]} and {ranks[1]} built different models: unit {label} "
        f"has parameters {described[0]} on rank {ranks[0]} and {described[index]} on rank "
        f"{ranks[1]} ({len(first)} and {len(other)} units in all). Build and annotate the "
        "model identically on every rank."
    )
