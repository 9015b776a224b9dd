"""How a module's unit state is found: fully_shard attaches it to each module of the unit,
and every reader asks here (the state lives in the module's __dict__, where an attribute
lookup or a deep copy does not reach it by accident)."""

from __future__ import annotations

from torch import nn

from .iteration import UnitState

_STATE_ATTR = "_fsdp_compose_state"


def attach(module: nn.Module, state: UnitState) -> None:
    module.__dict__[_STATE_ATTR] = state


def state_of(module: nn.Module) -> UnitState | None:
    """The unit state fully_shard attached to `module`, if any."""
    state: UnitState | None = module.__dict__.get(_STATE_ATTR)
    return state
