"""The first forward's check that every rank built the same model: once, cheaply, and raised
on every rank alike, instead of a hang or a size mismatch inside the first all-gather. In the
same exchange, a warning on every rank if they built different values (FSDP2 says nothing):
weights loaded on one rank only would be sharded into a model nobody built."""

from __future__ import annotations

import hashlib
import warnings
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..comm.collectives import all_gather_object, collective_failed
from ..unit.unit import Unit

# One rank's view: (label, digest of its parameters) per unit, its local problem, and the
# checksums of what it built per unit (None: not known, as for a meta-device model).
_RankView = tuple[list[tuple[str, str]], str | None, list[list[list[float]] | None]]


def check_ranks_agree(units: list[Unit], mesh: DeviceMesh, problem: str | None) -> None:
    """Raise on every rank of `mesh` if any rank has a `problem` (a local check's message)
    or if the ranks' units differ in names, shapes or dtypes of their parameters."""
    digests = [(u.label, hashlib.sha1("\n".join(_describe(u)).encode()).hexdigest()) for u in units]
    local: _RankView = (digests, problem, [_built(u) for u in units])
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
        if (rank_problem := next((p for _, p, _ in gathered if p is not None), None)) is not None:
            raise RuntimeError(rank_problem)
        for index, (described, _, _) in enumerate(gathered[1:], start=1):
            if described != gathered[0][0]:
                _raise_difference(units, gathered[0][0], described, group, index)
        _warn_of_values(units, [built for _, _, built in gathered], group)
    for unit in units:
        for p in unit.params:
            p.built = None


def _built(unit: Unit) -> list[list[float]] | None:
    checksums = [p.built for p in unit.params]
    if not checksums or any(c is None for c in checksums):
        return None
    return torch.stack(checksums).tolist()  # type: ignore[arg-type]  # none is None


def _warn_of_values(units: list[Unit], built: list[list[list[list[float]] | None]],
                    group: dist.ProcessGroup) -> None:
    """Warn, on every rank alike, of the first parameter two ranks built with other values."""
    for at, unit in enumerate(units):
        first = built[0][at]
        for index, rank_built in enumerate(built[1:], start=1):
            theirs = rank_built[at]
            if first is None or theirs is None or first == theirs:
                continue
            param = unit.params[next(i for i, (a, b) in enumerate(zip(first, theirs)) if a != b)]
            ranks = dist.get_global_rank(group, 0), dist.get_global_rank(group, index)
            warnings.warn(
                f"fsdp_compose: ranks {ranks[0]} and {ranks[1]} built parameter {param.fqn!r} "
                f"(unit {unit.label}) with different values, and each keeps its own shard of "
                "them: the model trained is none that a rank built. If one rank loaded the "
                "weights (say, a pretrained checkpoint on rank 0), pass "
                "sync_module_states=True to fully_shard or load them on every rank; if each "
                "rank initialised at random, this is harmless.", stacklevel=2,
            )
            return


def _describe(unit: Unit) -> list[str]:
    return [f"{p.fqn} {tuple(p.shape)} {p.sharded.dtype}" for p in unit.params]


def _raise_difference(
    units: list[Unit], first: list[tuple[str, str]], other: list[tuple[str, str]],
    group: dist.ProcessGroup, index: int,
) -> None:
    ranks = dist.get_global_rank(group, 0), dist.get_global_rank(group, index)
    labels = [label for label, _ in first], [label for label, _ in other]
    pairs = ((ranks[1], *labels), (ranks[0], *labels[::-1]))
    if missing := [(r, name) for r, mine, theirs in pairs for name in mine if name not in theirs]:
        rank, label = missing[0]
        found = f"rank {rank} has no unit {label}, which rank {sum(ranks) - rank} has"
    else:  # the same units: the first whose parameters differ, described by both ranks
        at = next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)
        # Every rank takes part in this second gather, so every rank raises the same error.
        described = all_gather_object(_describe(units[at]), group)
        found = (f"unit {first[at][0]} has parameters {described[0]} on rank {ranks[0]} and "
                 f"{described[index]} on rank {ranks[1]}")
    raise RuntimeError(
        f"fsdp_compose: ranks {ranks[0]} and {ranks[1]} built different models: {found} "
        f"({len(first)} and {len(other)} units in all). Build and annotate the model "
        "identically on every rank."
    )
