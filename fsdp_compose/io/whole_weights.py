"""A model's weights whole, unit by unit: `iter_full_state_dict` gathers each unit's shards and
hands them out one at a time; `load_whole_items` takes them back, each rank keeping its part."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..comm.collectives import all_gather, every_rank
from ..param.sharded_param import ShardedParam
from ..schedule.iteration import state_of
from ..unit.part import MeshPart

_GATHER_BYTES = 4 * 2**20  # the least a gather may hold: a unit of small tensors goes at once


def iter_full_state_dict(model: nn.Module, *, dtype: torch.dtype | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for each entry of `model.state_dict()`, whole as `full_tensor()`
    gives it (floating point ones cast to `dtype`); call on every rank and consume every item.
    One all-gather of exact bytes per mesh and unit (or piece of at least 4 MiB), and one per
    tensor-parallel parameter: a rank holds its shards, one gather and the tensor handed out."""
    order = full_state_dict_order(model)
    # A gather's bytes: at most the largest parameter's (alone, it is handed out as a view of
    # its gathered rows), or more small ones together.
    cap = max([_GATHER_BYTES] + [p.padded_shard.nbytes * p.layout.shard_size
                                 for part, _ in order if part is not None for p in part.params])
    state = model.state_dict() if any(part is None for part, _ in order) else {}
    for part, names in order:
        if part is None:
            for name in names:
                yield name, _cast(_whole(state[name]), dtype)
            continue
        named = [(p, n) for p, n in zip(part.params, names) if n]
        # Shards with all-gather hooks of their own (tensor subclasses): their own gather.
        own = [p.extension is not None and p.extension.hooks is None for p, _ in named]
        for (p, name_group), hooked in zip(named, own):
            if hooked:
                whole = p.sharded.full_tensor()  # type: ignore[attr-defined]
                yield from ((name, _cast(whole, dtype)) for name in name_group)
        plain = [item for item, hooked in zip(named, own) if not hooked]
        for chunk in _chunks(plain, cap):
            gathered, offsets = _gather_bytes(part, [p for p, _ in chunk])
            for (p, start, end), (_, name_group) in zip(offsets, chunk):
                whole = p.whole_from_rows(gathered[:, start:end].view(p.padded_shard.dtype))
                yield from ((name, _cast(whole, dtype)) for name in name_group)
                del whole  # (the consumer's reference alone keeps it)
            del gathered


def full_state_dict_order(model: nn.Module) -> list[tuple[MeshPart | None, list[Any]]]:
    """Parts in state-dict order, each with a list of names per parameter (tied ones: several);
    entries of no unit (buffers, ignored parameters) in runs of their own, under None."""
    of_param = {id(p.sharded): (part, p) for m in model.modules() if (s := state_of(m)) is not None
                for part in s.unit.parts for p in part.params}
    order: list[tuple[MeshPart | None, list[Any]]] = []
    by_part: dict[int, dict[int, list[str]]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        source = of_param.get(id(value))  # None: not a sharded parameter
        if source is None:
            if not order or order[-1][0] is not None:
                order.append((None, []))
            order[-1][1].append(name)
            continue
        part, p = source
        if id(part) not in by_part:
            by_part[id(part)] = {id(q): [] for q in part.params}
            order.append((part, list(by_part[id(part)].values())))  # filled as the loop goes on
        by_part[id(part)][id(p)].append(name)
    return order


def _chunks(params: list[tuple[ShardedParam, list[str]]], cap: int
            ) -> Iterator[list[tuple[ShardedParam, list[str]]]]:
    """Runs of the parameters, each of at most `cap` gathered bytes (or one parameter)."""
    chunk: list[tuple[ShardedParam, list[str]]] = []
    size = 0
    for p, names in params:
        nbytes = p.padded_shard.nbytes * p.layout.shard_size
        if chunk and size + nbytes > cap:
            yield chunk
            chunk, size = [], 0
        chunk.append((p, names))
        size += nbytes
    if chunk:
        yield chunk


def _gather_bytes(part: MeshPart, params: list[ShardedParam]
                  ) -> tuple[torch.Tensor, list[tuple[ShardedParam, int, int]]]:
    """Every rank's padded shards of `params` as bytes (rank r's in row r; this rank's written
    in place) and each one's columns (8-byte aligned: they view as any dtype)."""
    mesh = part.mesh
    sizes = [p.padded_shard.nbytes for p in params]
    starts = list(itertools.accumulate((n + -n % 8 for n in sizes[:-1]), initial=0))
    width = starts[-1] + sizes[-1]  # (no padding after the last: a lone one's rows are contiguous)
    gathered = torch.empty((mesh.shard_size, width), dtype=torch.uint8, device=mesh.device)
    row = gathered[mesh.shard_rank]
    torch._foreach_copy_([row[a : a + n] for a, n in zip(starts, sizes)],  # (offload: from the CPU)
                         [p.padded_shard.reshape(-1).view(torch.uint8) for p in params])
    all_gather(gathered.view(-1), row, mesh.shard_group, mesh.shard_size, async_op=False)
    return gathered, [(p, a, a + n) for p, a, n in zip(params, starts, sizes)]


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value.detach()


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def load_whole_items(model: nn.Module, items: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `(name, tensor)` whole, in any order (the same on every rank), into `model`. Each rank
    keeps its part as it arrives (a copy of its shards at the peak); a mismatch changes nothing."""
    state = model.state_dict()
    sharded = {name: p for part, names in full_state_dict_order(model) if part is not None
               for p, group in zip(part.params, names) for name in group}
    given: dict[str, tuple[int, ...]] = {}
    staged: dict[str, torch.Tensor] = {}
    for name, whole in items:
        given[name] = tuple(whole.shape)
        target = state.get(name)
        if target is not None and given[name] == tuple(target.shape):
            staged[name] = _part_of(whole.detach(), target, sharded.get(name))
    problem = mismatches(given, state, "given") or None
    if errors := [p for p in every_rank(problem) if p is not None]:
        raise ValueError(f"load_full_state_dict: the tensors given do not match the model: "
                         f"{errors[0]}; nothing was loaded.")
    model.load_state_dict(staged)


def mismatches(saved: Mapping[str, tuple[int, ...]], model_state: Mapping[str, Any],
               source: str = "checkpoint") -> str:
    """Where the names and shapes `saved` (or given) and a model's state dict differ, in words."""
    model = {k: tuple(v.shape) for k, v in model_state.items()}
    found = {"missing keys": [k for k in model if k not in saved],
             "unexpected keys": [k for k in saved if k not in model],
             "shape mismatches": [f"{k!r}: {source} {saved[k]}, model {shape}"
                                  for k, shape in model.items() if saved.get(k, shape) != shape]}
    return "; ".join(f"{label} {items}" for label, items in found.items() if items)


def _part_of(whole: torch.Tensor, target: torch.Tensor, ours: ShardedParam | None) -> torch.Tensor:
    """This rank's part of `whole`, laid out as `target` (a DTensor: its shard), a copy; ours cut
    as its shard is (a view, then copied: DTensor's own split copies `whole` first)."""
    if not isinstance(target, DTensor):
        return whole.to(target.device, target.dtype, copy=True)
    whole = whole.to(target.to_local().device, target.dtype)
    part = ours.shard_of(whole) if ours is not None else distribute_tensor(
        whole, target.device_mesh, target.placements, src_data_rank=None)
    return DTensor.from_local(part.to_local().clone(), target.device_mesh, target.placements,
                              run_check=False, shape=target.shape, stride=target.stride())
