"""Initialisation: a model annotated on the meta device, materialised one module at a time;
every rank starting from the first rank's weights; buffers moved to the mesh's device."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..comm.collectives import broadcast
from ..param.sharded_param import ShardedParam
from ..schedule.iteration import state_of


def materialize(module: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Give the meta parameters and buffers under annotated `module` values on the units'
    devices, one module at a time: its own tensors whole, then this rank's shards (peak
    memory: the shards plus the largest module's own parameters). Each module owning meta
    tensors gets `init_fn(module)` (default: `reset_parameters()`), children first, so that
    with one seed on every rank the values are those of the unsharded model after
    `model.to_empty(device=...)` and `model.apply(init_fn)`:

        torch.manual_seed(0)  # the same on every rank
        materialize(model, init_fn=init_weights)  # after fully_shard on the meta model
    """
    if (root := state_of(module)) is None:
        raise TypeError(f"materialize({type(module).__name__}): the module is not annotated; "
                        "call fully_shard on it (and its blocks) first.")
    if init_fn is None:
        _check_resettable(module)
    init = init_fn or (lambda m: m.reset_parameters())  # type: ignore[operator]
    states = [state for m in module.modules() if (state := state_of(m)) is not None]
    # (id(owner), attribute) -> the sharded parameter there
    owned = {(id(owner), attr): param for state in states for param in state.unit.params
             for owner, attr in param.owners}
    whole: dict[ShardedParam, nn.Parameter] = {}
    owners_left: dict[ShardedParam, int] = {}

    def visit(m: nn.Module, device: torch.device) -> None:
        if (state := state_of(m)) is not None:
            device = state.unit.device
        for child in m.children():
            visit(child, device)
        mine = [(attr, owned.get((id(m), attr))) for attr in m._parameters]
        if not _materialize_own(m, mine, device, whole, owners_left):
            return
        init(m)
        for _, param in mine:  # after its last owner's init, keep this rank's shard of `param`
            if param is not None and param in whole:
                owners_left[param] -= 1
                if not owners_left[param]:
                    param.materialize(whole.pop(param).detach())
                    for owner, attr in param.owners:
                        owner._parameters[attr] = param.sharded

    with torch.no_grad():
        visit(module, root.unit.device)
    for state in states:
        state.unit.shards_replaced()


def _materialize_own(
    m: nn.Module, mine: list[tuple[str, ShardedParam | None]], device: torch.device,
    whole: dict[ShardedParam, nn.Parameter], owners_left: dict[ShardedParam, int],
) -> bool:
    """Replace `m`'s own meta tensors by empty whole ones on `device`; return whether any."""
    to_init = False
    for attr, param in mine:
        if param is not None and param.is_meta:
            if param.is_tensor_parallel:
                raise NotImplementedError(
                    f"materialize: {type(m).__name__}.{attr} is tensor-parallel; materialise "
                    "before parallelize_module, or use model.to_empty(device=...) and init.")
            if param not in whole:
                tensor = torch.empty(param.layout.shape, dtype=param.sharded.dtype, device=device)
                whole[param] = nn.Parameter(tensor, requires_grad=param.sharded.requires_grad)
                owners_left[param] = len(param.owners)
                for owner, owner_attr in param.owners:
                    owner._parameters[owner_attr] = whole[param]
            to_init = True
        elif param is None and (plain := m._parameters[attr]) is not None and plain.is_meta:
            empty = torch.empty_like(plain, device=device)
            m._parameters[attr] = nn.Parameter(empty, requires_grad=plain.requires_grad)
            to_init = True
    for attr, buffer in m._buffers.items():
        if buffer is not None and buffer.is_meta:
            m._buffers[attr] = torch.empty_like(buffer, device=device)
            to_init = True
    return to_init


def _check_resettable(module: nn.Module) -> None:
    """Before anything changes: every module with meta tensors of its own can reset them."""
    for fqn, m in module.named_modules():
        own = [*m._parameters.values(), *m._buffers.values()]
        on_meta = any(t is not None and t.is_meta for t in own)
        if on_meta and not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(
                f"materialize: {type(m).__name__} at {fqn or '<root>'!r} has parameters or "
                "buffers on the meta device but no reset_parameters(); pass init_fn=<function>.")


def sync_from_first_rank(tensors: Iterable[torch.Tensor], mesh: DeviceMesh,
                         device: torch.device) -> None:
    """Overwrite `tensors` (DTensors: their local tensor; not meta ones) on every rank of the
    data-parallel `mesh` with its first rank's: one broadcast per dtype and mesh dim."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if not local.is_meta:
            by_dtype.setdefault(local.dtype, []).append(local.detach())
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group]).to(device)
        # After dim 0, rank (i, j) holds (0, j)'s values; after dim 1, (0, 0)'s.
        for dim in range(mesh.ndim):
            broadcast(flat, mesh.get_group(dim))
        for t, values in zip(group, torch.split(flat, [t.numel() for t in group])):
            t.copy_(values.view_as(t))


def move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    """Move buffers to the mesh's device, as sharding moves parameters (not meta ones)."""
    for module in (sub for m in modules for sub in m.modules()):
        for attr, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device and not buffer.is_meta:
                module._buffers[attr] = buffer.to(device)
