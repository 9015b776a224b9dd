"""State dicts of annotated modules: always the sharded DTensors under the original names;
loading takes sharded DTensors or whole tensors (sharded on the way in)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..param.sharded_param import ShardedParam
from ..schedule.iteration import UnitState
from ..schedule.phase import IDLE


def install_state_dict_hooks(state: UnitState) -> None:
    for module in state.modules:
        module.register_state_dict_post_hook(
            lambda m, sd, prefix, _meta: _report_sharded(state, m, sd, prefix))
        module.register_load_state_dict_pre_hook(
            lambda m, sd, prefix, *_: _shard_loaded(state, m, sd, prefix))
        # load_state_dict(assign=True) replaces parameters: take them back as shards.
        module.register_load_state_dict_post_hook(lambda m, _keys: state.unit.adopt_registered())


def _keys(state: UnitState, module: nn.Module,
          prefix: str) -> Iterator[tuple[str, ShardedParam, nn.Module, str]]:
    """(key, parameter, owner, attribute) for the unit's parameters, borrowed ones included."""
    names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    for param in (*state.unit.params, *state.borrowed_params):
        for owner, attr in param.owners:
            if (name := names.get(id(owner))) is not None:
                yield f"{prefix}{name}.{attr}" if name else f"{prefix}{attr}", param, owner, attr


def _report_sharded(state: UnitState, module: nn.Module, sd: dict[str, Any], prefix: str) -> None:
    """Put the shards where state_dict() found unsharded parameters."""
    if not state.unit.is_unsharded and not state.borrowed_params:
        return
    for key, param, owner, attr in _keys(state, module, prefix):
        if owner._parameters[attr] is param.unsharded and key in sd:
            # state_dict(keep_vars=True) holds the parameter itself, else a detached one.
            sd[key] = param.sharded if sd[key] is param.unsharded else param.sharded.detach()


def _shard_loaded(state: UnitState, module: nn.Module, sd: dict[str, Any], prefix: str) -> None:
    """Load into the shards: reshard the unit (its unsharded data would be stale) and cut
    whole tensors to this rank's shard; other shapes go on to load_state_dict's error."""
    if state.unit.is_unsharded:
        if state.phase is not IDLE:
            raise RuntimeError(f"load_state_dict: unit {state.label or type(module).__name__} "
                               f"is in its {state.phase.name.lower()} phase; load between steps.")
        state.unit.reshard()
    for key, param, _, _ in _keys(state, module, prefix):
        if isinstance(value := sd.get(key), torch.Tensor) and not isinstance(value, DTensor):
            if value.shape == param.shape:
                sd[key] = param.shard_of(value)
