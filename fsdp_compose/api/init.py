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
from ..schedule.state import state_of


def materialize(module: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Give the meta parameters and buffers under annotated `module` real values on the
    units' devices, one module at a time: whole tensors for one module's own parameters,
    then each rank keeps its shard.

    Each module that owns meta parameters or buffers gets `init_fn(module)`, by default its
    `reset_parameters()`, children before parents (the order of `Module.apply`). The rule
    that makes it deterministic: every rank runs the same initialisation on whole tensors
    from its random generator, so with the same seed on every rank the values are those of
    the non-sharded model after `model.to_empty(device=...)` and `model.apply(init_fn)`
    from that seed. With the default, that is the model built on the device directly,
    whenever its modules create their parameters with their own `reset_parameters()` in
    module order (as torch.nn layers do). `init_fn(module)` initialises the module's own
    parameters and buffers; its submodules' are already sharded by then.

        with torch.device("meta"):
            model = GPT(config)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        torch.manual_seed(0)                  # the same on every rank
        materialize(model, init_fn=init_weights)

    Peak memory: the shards plus the largest module's own parameters, whole (a parameter
    tied between modules stays whole until the last of them is initialised).
    """
    if (root := state_of(module)) is None:
        raise TypeError(
            f"materialize({type(module).__name__}): the module is not annotated; call "
            "fully_shard on it (and its blocks) first, then materialize it."
        )
    if init_fn is None:
        _check_resettable(module)
    owned = _owned_params(module)
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
        if init_fn is not None:
            init_fn(m)
        else:
            m.reset_parameters()  # type: ignore[operator]
        for _, param in mine:
            if param is not None and param in whole:
                _shard_if_done(param, whole, owners_left)

    with torch.no_grad():
        visit(module, root.unit.device)
    for m in module.modules():
        if (state := state_of(m)) is not None:
            state.unit.shards_replaced()


def _owned_params(module: nn.Module) -> dict[tuple[int, str], ShardedParam]:
    """(id(owner), attribute) -> the sharded parameter there, for every unit under `module`."""
    return {
        (id(owner), attr): param
        for m in module.modules() if (state := state_of(m)) is not None
        for param in state.unit.params for owner, attr in param.owners
    }


def _shard_if_done(
    param: ShardedParam, whole: dict[ShardedParam, nn.Parameter], owners_left: dict[ShardedParam, int]
) -> None:
    """One owner of `param` was initialised: once the last was, keep this rank's shard."""
    owners_left[param] -= 1
    if not owners_left[param]:
        param.materialize(whole.pop(param).detach())
        for owner, attr in param.owners:
            owner._parameters[attr] = param.sharded


def _materialize_own(
    m: nn.Module,
    mine: list[tuple[str, ShardedParam | None]],
    device: torch.device,
    whole: dict[ShardedParam, nn.Parameter],
    owners_left: dict[ShardedParam, int],
) -> bool:
    """Replace `m`'s own meta tensors by uninitialised ones on `device` (whole tensors for
    sharded parameters); return whether `m` has any left to initialise."""
    to_init = False
    for attr, param in mine:
        if param is not None and param.is_meta:
            if param.is_tensor_parallel:
                raise NotImplementedError(
                    f"materialize: {type(m).__name__}.{attr} is tensor-parallel; materialise "
                    "the model before parallelize_module, or use model.to_empty(device=...) "
                    "and initialise the DTensor parameters."
                )
            if param not in whole:
                tensor = torch.empty(param.layout.shape, dtype=param.sharded.dtype, device=device)
                whole[param] = nn.Parameter(tensor, requires_grad=param.sharded.requires_grad)
                owners_left[param] = len(param.owners)
                for owner, owner_attr in param.owners:
                    owner._parameters[owner_attr] = whole[param]
            to_init = True
        elif param is None and (plain := m._parameters[attr]) is not None and plain.is_meta:
            m._parameters[attr] = nn.Parameter(
                torch.empty_like(plain, device=device), requires_grad=plain.requires_grad
            )
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
                "buffers on the meta device but no reset_parameters(); pass "
                "init_fn=<function of a module> that initialises them."
            )


def unit_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The buffers under `modules` outside inner units (those synced their own)."""
    found: list[torch.Tensor] = []

    def visit(m: nn.Module) -> None:
        found.extend(b for b in m._buffers.values() if b is not None)
        for child in m.children():
            if state_of(child) is None:
                visit(child)

    for m in modules:
        visit(m)
    return found


def sync_from_first_rank(
    tensors: Iterable[torch.Tensor], mesh: DeviceMesh, device: torch.device
) -> None:
    """Overwrite `tensors` on every rank of `mesh` (the data-parallel mesh) with the values
    of its first rank (one broadcast per dtype and mesh dimension). A tensor-parallel
    DTensor's local shard is what is sent: each rank gets the shard of the rank that holds
    the same tensor-parallel part in its data-parallel group's first replica. Meta tensors
    have no values and are skipped."""
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
    """Buffers follow their parameters to the mesh's device (parameters move by sharding);
    meta buffers wait for `materialize`."""
    for m in modules:
        for module in m.modules():
            for attr, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device and not buffer.is_meta:
                    module._buffers[attr] = buffer.to(device)
