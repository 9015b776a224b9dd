"""How a part's parameters lie in memory and travel: their padded shards (each its own tensor,
as optimizers and serialization expect), their unsharded data in one storage, their
registrations by owning module, and the dtypes and sizes both collectives use; built anew when
the parameters change."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from ..comm.meshes import UnitMesh, shard_mesh
from ..param.codec import AllGatherCodec, CodecHooks
from ..param.extension import GatherExtension, carried_problem, has_extension
from ..param.sharded_param import ShardedParam

# One owning module's _parameters, and the sharded and the unsharded forms of its
# parameters in a unit, by name: what one dict update registers.
OwnerForms = tuple[dict[str, Any], dict[str, nn.Parameter], dict[str, nn.Parameter]]
# The spec of a collective's rows: (shape, dtype, device); see ReusedBuffer.take.
BufferSpec = tuple[tuple[int, int], torch.dtype, torch.device]


@dataclasses.dataclass(frozen=True, slots=True)
class DtypeFacts:
    """What the parameters' dtypes make of a part's collectives."""

    param_dtype: torch.dtype  # what the first parameter gathers and computes in
    reduce_dtype: torch.dtype  # the widest reduce dtype of the parameters that train
    is_complex: bool  # sent as real pairs
    mixed_dtypes: bool  # the parameters gather in different dtypes: sent as bytes


@dataclasses.dataclass(frozen=True, slots=True)  # slots: read at every gather and reduction
class Layout:
    """One part's parameters laid out. Immutable: a change to the parameters builds a new one."""

    dtypes: DtypeFacts
    # Every padded shard, where one foreach copy (casting to param_dtype, moving from the CPU)
    # puts them in the all-gather's own row; None when sent as bytes (encode_shards).
    shards: list[torch.Tensor] | None
    gather_spec: BufferSpec | None  # of that all-gather
    reduce_spec: BufferSpec  # of a reduce-scatter of every parameter's gradient
    storages: list[tuple[torch.UntypedStorage, int]]  # unsharded data, freed as size 0
    targets: list[torch.Tensor]  # where each parameter's gathered rows land
    registrations: list[OwnerForms]
    extended: list[ShardedParam]  # with all-gather hooks or a codec: see param/extension.py
    # A group of one rank (no extension, no custom all-gather) gathers nothing. Where
    # its shards are already what computes (dtype, device), the unsharded parameters are
    # views of them (zero_copy); else one foreach copy casts (and moves, from the CPU) each
    # padded shard into its unsharded data, flat (cast_in: those targets, then the shards).
    zero_copy: bool
    cast_in: tuple[list[torch.Tensor], list[torch.Tensor]] | None


def dtype_facts(params: list[ShardedParam]) -> DtypeFacts:
    training = [p.reduce_dtype for p in params if p.sharded.requires_grad]
    first = params[0]
    return DtypeFacts(
        param_dtype=first.param_dtype,
        reduce_dtype=functools.reduce(torch.promote_types, training or [first.reduce_dtype]),
        is_complex=first.param_dtype.is_complex,
        mixed_dtypes=len({p.param_dtype for p in params}) > 1,
    )


def lay_out(
    params: list[ShardedParam], mesh: UnitMesh, sizes: list[int], label: str,
    refuse_unhooked: bool, codecs: dict[ShardedParam, AllGatherCodec], custom_gather: bool,
) -> Layout | None:
    """Lay `params` out over `mesh`, unsharded storages freed. None when a tensor-subclass shard
    has no all-gather hooks yet and not `refuse_unhooked` (hooks may come before the first
    gather). With a `custom_gather` even one rank gathers."""
    if not _find_extensions(params, mesh, label, refuse_unhooked, codecs):
        return None
    extended = [p for p in params if p.extension is not None]
    dtypes = dtype_facts(params)
    rows, numel, device = mesh.shard_size, sum(sizes), mesh.device
    padded = [p.padded_shard for p in params]
    same = not extended and not dtypes.mixed_dtypes  # one dtype sent: see Layout.shards
    gather_spec = ((rows, numel), dtypes.param_dtype, device) if same else None
    one_rank = rows == 1 and not extended and not custom_gather
    zero_copy = one_rank and all(
        (p.padded_shard.dtype, p.padded_shard.device) == (p.param_dtype, device) for p in params
    )
    buffers: list[torch.Tensor] = []
    if zero_copy:
        for p in params:
            p.use_unsharded_buffer(p.padded_shard)
    elif plain := [p for p in params if p.extension is None]:  # hooks build their own
        buffers = unsharded_buffers(plain, rows, dtypes.param_dtype, device)
    # Freed by resizing to 0 rather than dropped: autograd may have saved the unsharded
    # parameters, and what it saved must see the data of the next all-gather.
    storages = [(b.untyped_storage(), b.nbytes) for b in buffers]
    for storage, _ in storages:
        storage.resize_(0)
    cast_in = None
    if one_rank and not zero_copy:  # the buffers' .data: Note [version counter] in sharded_param.py
        cast_in = [p.unsharded_buffer.data for p in params], [p.padded_shard for p in params]
    return Layout(
        dtypes=dtypes, shards=padded if same else None, gather_spec=gather_spec,
        reduce_spec=((rows, numel), dtypes.reduce_dtype, device), storages=storages,
        targets=[p.gather_target for p in params], registrations=forms_by_owner(params),
        extended=extended, zero_copy=zero_copy, cast_in=cast_in,
    )


def _find_extensions(
    params: list[ShardedParam], mesh: UnitMesh, label: str, refuse_unhooked: bool,
    codecs: dict[ShardedParam, AllGatherCodec],
) -> bool:
    """Give each parameter with a codec, or whose local shard has all-gather hooks, a
    GatherExtension (kept while they are), and no other one. Whether every tensor-subclass
    shard has hooks."""
    for p in params:
        where = f"fsdp_compose: unit {label}: parameter {p.fqn!r}"
        old = None if p.extension is None else p.extension.hooks  # None: the shard's own
        if (codec := codecs.get(p)) is not None:
            same = getattr(old, "codec", None) is codec
            hooks: CodecHooks | None = old if same else CodecHooks(codec, p, mesh.device)
        elif has_extension(p.local, where):
            hooks = None
        else:
            if (problem := carried_problem(where, p.local)) is not None:
                if refuse_unhooked:  # on every rank alike: they hold the same model
                    raise TypeError(problem)
                return False
            p.extension = None
            continue
        if p.extension is None or hooks is not old:
            module, mesh_1d = p.owners[0][0], shard_mesh(mesh.mesh)
            p.extension = GatherExtension(p.fqn, module, mesh_1d, p.shape, p.mp_policy, hooks)
    return True


def unsharded_buffers(
    params: list[ShardedParam], rows: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """The unsharded data: one storage shared by the parameters when they compute in one
    dtype, else each its own (new: an earlier layout may have lent them their shards)."""
    if not all(p.param_dtype == dtype for p in params):
        for p in params:
            p.allocate_unsharded_buffer(device)
        return [p.unsharded_buffer for p in params]
    sizes = [rows * p.layout.padded_shard_numel for p in params]
    with torch.inference_mode(False):
        unsharded = torch.empty(sum(sizes), dtype=dtype, device=device)
        for p, piece in zip(params, unsharded.split(sizes)):
            p.use_unsharded_buffer(piece)
    return [unsharded]


def forms_by_owner(params: list[ShardedParam]) -> list[OwnerForms]:
    """The parameters' registrations grouped by owning module."""
    by_owner: dict[int, OwnerForms] = {}
    for p in params:
        for r in p.registrations():
            _, sharded, unsharded = by_owner.setdefault(id(r.parameters), (r.parameters, {}, {}))
            sharded[r.name] = r.sharded
            unsharded[r.name] = r.unsharded
    return list(by_owner.values())
