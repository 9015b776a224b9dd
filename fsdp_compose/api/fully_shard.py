"""fully_shard(): check arguments, build a unit, install its hooks; and the module-level
functions beside it (register_fsdp_forward_method, share_comm_ctx)."""

from __future__ import annotations

import functools
from typing import Any, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.meshes import DataParallelMeshDims, UnitMesh, default_mesh, unit_mesh
from ..param.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, adopt_policy
from ..param.replaced import mark_replaced
from ..param.sharded_param import ShardedParam
from ..schedule.hooks import install_hooks, post_forward, pre_forward
from ..schedule.iteration import UnitState, attach, state_of
from ..schedule.tied import OWNER_ATTR, Borrowed, check_borrowable, lend, owner_of
from ..schedule.unmanaged import watch
from ..unit.part import MeshPart
from ..unit.settings import UnitSettings
from ..unit.unit import Unit
from . import checks
from .fsdp_module import FSDPModule
from .init import move_buffers, sync_from_first_rank
from .placement import ShardPlacementFn, shard_placements
from .setters import annotated_states
from .state_dict import install_state_dict_hooks

_MANAGED_MARKERS = {"_is_fsdp_managed_module": True, "_fsdp_use_orig_params": True}


@functools.cache
def _annotated_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


@overload
def fully_shard(
    module: nn.Module, *, mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: ShardPlacementFn | None = ..., mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ..., ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ..., sync_module_states: bool = ...,
) -> FSDPModule: ...
@overload
def fully_shard(
    module: list[nn.Module], *, mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: ShardPlacementFn | None = ..., mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ..., ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ..., sync_module_states: bool = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None, sync_module_states: bool = False,
) -> FSDPModule | list[FSDPModule]:
    """Shard `module`'s parameters over `mesh`; gather them only while it computes.

    In place: the module keeps its class (now also an FSDPModule), submodules and parameter
    names; its parameters become DTensors sharded on dim 0 (build the optimizer afterwards).
    Call it bottom-up, each call claiming what no inner call claimed (a list forms one unit):
    `for block in model.layers: fully_shard(block)`, then `fully_shard(model)`.

    `reshard_after_forward`: free the unsharded parameters after forward (None: True, but the
    root keeps them); an int k dividing the shard size keeps them sharded over k ranks.
    `offload_policy=CPUOffloadPolicy()` keeps shards, gradients and the optimizer step on CPU.
    `ignored_params` are neither sharded nor reduced. Meta-device models get values from
    `materialize`. Ours: `sync_module_states=True` first copies the mesh's first rank's
    parameters and buffers to every rank. A call that raises leaves `module` untouched."""
    modules = list(module) if isinstance(module, list) else [module]
    checks.check_modules(modules)
    name = ", ".join(type(m).__name__ for m in modules)
    mp_policy, offload_policy = adopt_policy(mp_policy), adopt_policy(offload_policy)
    checks.check_options(name, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh(name)
    checks.check_mesh(f"fully_shard({name})", mesh, dp_mesh_dims, reshard_after_forward)
    resolved = unit_mesh(mesh, reshard_after_forward, dp_mesh_dims)
    collected = checks.collect_params(modules, set(ignored_params or ()))
    owners = [owner_of(param) for _, param, _ in collected]  # tied to another unit's: borrowed
    borrowed = [Borrowed(fqn, *o, holders) for (fqn, _, holders), o in zip(collected, owners) if o]
    for tied in borrowed:
        check_borrowable(name, tied, resolved, mp_policy)
    collected = [c for c, owner in zip(collected, owners) if owner is None]
    placements = shard_placements(
        name, collected, shard_placement_fn, resolved, reshard_after_forward)
    checks.check_params(name, collected, resolved.device, [m for _, m in placements])
    policies = [mp_policy.for_param(fqn, p) for fqn, p, _ in collected]  # may raise
    if sync_module_states:
        # The parameters and buffers outside inner units (those synced their own).
        buffers = (o._buffers.values() for m in modules for _, o in checks.unit_modules(m))
        tensors = [p for _, p, _ in collected] + [b for bs in buffers for b in bs if b is not None]
        sync_from_first_rank(tensors, resolved.mesh, resolved.device)  # data-parallel dims only
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    params = [
        ShardedParam(fqn, p, holders, param_mesh, policy, offload, dim)
        for (fqn, p, holders), (dim, param_mesh), policy in zip(collected, placements, policies)
    ]
    _annotate(modules, name, collected, params, placements, borrowed, resolved, mp_policy)
    # Until the first forward, look for parameters no unit manages: see schedule/unmanaged.py.
    sharded = [p for m in modules for p in m.parameters() if getattr(p, checks.SHARDED_MARK, False)]
    watch(state_of(modules[0]), [*sharded, *(ignored_params or ())])
    return module  # type: ignore[return-value]  # annotated in place: now FSDPModules


# As torch's: fully_shard.state(module) is the module's state (here its UnitState, or None).
fully_shard.state = state_of  # type: ignore[attr-defined]


def _annotate(
    modules: list[nn.Module], name: str, collected: checks.Collected, params: list[ShardedParam],
    placements: list[tuple[int, UnitMesh]], borrowed: list[Borrowed], resolved: UnitMesh,
    mp_policy: MixedPrecisionPolicy,
) -> None:
    """Shard the checked parameters, build the unit, install its hooks, borrow the tied."""
    move_buffers(modules, resolved.device)
    # One part per mesh of the parameters (see shard_placement_fn), the unit's mesh first.
    by_mesh: dict[int, tuple[UnitMesh, list[ShardedParam]]] = {id(resolved): (resolved, [])}
    for param, (_, param_mesh) in zip(params, placements):
        by_mesh.setdefault(id(param_mesh), (param_mesh, []))[1].append(param)
    settings = UnitSettings(reshard_after_forward=resolved.reshard_after_forward)
    unit = Unit([MeshPart(g, mesh, name, settings) for mesh, g in by_mesh.values()], settings)
    unit.set_post_forward_meshes([mesh.post_forward_mesh for mesh, _ in by_mesh.values()])
    state = UnitState(modules, unit, mp_policy)
    for (_, original, _), param in zip(collected, params):
        setattr(param.sharded, checks.SHARDED_MARK, True)
        setattr(original, OWNER_ATTR, (state, param))
        param.to_sharded()
    for m in modules:
        for managed in m.modules():  # the markers torch's fully_shard sets, which
            managed.__dict__.update(_MANAGED_MARKERS)  # transformers and dynamo read
        attach(m, state)
        cls: type = type(m)  # as a plain type: functools.cache wants it hashable
        m.__class__ = _annotated_class(cls)
    install_hooks(state)
    install_state_dict_hooks(state)
    mark_replaced(name, ((fqn, param) for fqn, param, _ in collected))
    for tied in borrowed:
        lend(tied, state)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Make the roots `modules` (e.g. pipeline stages on one rank) share one communication
    context: one bound on prefetched all-gathers and on reductions in flight between them."""
    states = annotated_states(modules, "share_comm_ctx")
    for state in states[1:]:
        for other in state.root.states if state.initialised else [state]:
            other.comm = states[0].comm


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` gather and free parameters as `forward` does (e.g. a
    `generate` that does not call forward). A no-op when `module` is not annotated."""
    if not isinstance(module, FSDPModule):
        return
    if (method := getattr(module, method_name, None)) is None:
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register")
    state = module._state()

    @functools.wraps(method)
    def forward_method(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(state, module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            # As nn.Module calls a forward hook when forward raised: undo the pre-hook.
            post_forward(state, module, args, None)
            raise
        return post_forward(state, module, args, output)

    setattr(module, method_name, forward_method)
