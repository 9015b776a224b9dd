"""Parameters tied across units (an embedding and an LM head in different units): the first
unit to annotate one owns it, gathers it and reduces its gradient once; a later unit holding it
borrows it, gathering the owner before its passes (docs/design.md, "Parameters tied across
units"). A lender keeps its parameters from forward to backward: a borrower may run in between."""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from ..comm.meshes import UnitMesh
from ..param.policies import MixedPrecisionPolicy
from ..param.sharded_param import ShardedParam
from .iteration import UnitState

# Set on each parameter a unit sharded (the object modules held before), to find its
# owner where another module still holds it.
OWNER_ATTR = "_fsdp_compose_owner"


class Borrowed(NamedTuple):
    fqn: str  # in the borrowing unit
    owner: UnitState
    param: ShardedParam
    holders: list[tuple[nn.Module, str]]  # the borrowing unit's modules that hold it


def owner_of(param: nn.Parameter) -> tuple[UnitState, ShardedParam] | None:
    owner: tuple[UnitState, ShardedParam] | None = getattr(param, OWNER_ATTR, None)
    return owner


def check_borrowable(name: str, borrowed: Borrowed, mesh: UnitMesh, mp: MixedPrecisionPolicy,
                     ) -> None:
    """The borrower computes with the owner's gathered tensor: refuse another mesh or dtype."""
    owner, param = borrowed.owner, borrowed.param
    dtype = mp.param_dtype or param.sharded.dtype
    if owner.unit.mesh != mesh.mesh or param.param_dtype != dtype:
        raise ValueError(
            f"fully_shard({name}): parameter {borrowed.fqn!r} is tied to {param.fqn!r} of unit "
            f"{owner.label}, which gathers it on {owner.unit.mesh} in {param.param_dtype}; "
            f"this unit would use {mesh.mesh} and {dtype}. Tied parameters shared by units "
            "need one mesh and one param_dtype: annotate both with the same mesh and "
            "MixedPrecisionPolicy, or the modules that share it as one unit."
        )


def lend(borrowed: Borrowed, borrower: UnitState) -> None:
    """Register the owner's sharded parameter in the borrowing modules too; tell both units."""
    param = borrowed.param
    param.owners.extend(borrowed.holders)
    for module, attr in borrowed.holders:
        module._parameters[attr] = param.sharded
    owner = borrowed.owner
    owner.unit.shards_replaced()  # its registrations now include the borrowers
    owner.lends = True
    owner.backward_end.may_end_on_inputs = False  # see BackwardEnd
    borrower.borrowed_params.append(param)
    if owner not in borrower.borrowed_from:
        borrower.borrowed_from.append(owner)
