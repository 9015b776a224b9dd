"""MixedPrecisionPolicy, OffloadPolicy and CPUOffloadPolicy: what a unit stores and computes in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of a unit's unsharded parameters, gradient reduction and outputs.

    `param_dtype`: of the unsharded parameters (all-gather and compute); None: the original.
    `reduce_dtype`: of the gradient reduction; None: as the running torch's fully_shard does.
    `output_dtype`: floating-point outputs are cast to it. `cast_forward_inputs`: floating-point
    inputs are cast to `param_dtype`. `param_dtype_override_fn(param)` (ours on every torch):
    called once per parameter, alike on every rank; None or `param_dtype` keeps the default,
    the parameter's own dtype keeps the parameter in it."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )

    def for_param(self, fqn: str, param: nn.Parameter) -> MixedPrecisionPolicy:
        """The policy of one parameter: `param_dtype_override_fn` applied."""
        if self.param_dtype_override_fn is None:
            return self
        override = self.param_dtype_override_fn(param)
        if override is not None and override not in (self.param_dtype, param.dtype):
            raise ValueError(
                f"param_dtype_override_fn returned {override!r} for parameter {fqn!r} "
                f"({param.dtype}); it must return None, param_dtype ({self.param_dtype}) or the "
                "parameter's own dtype."
            )
        return replace(self, param_dtype=override or self.param_dtype, param_dtype_override_fn=None)


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep sharded parameters and gradients where the mesh is (no offload)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in CPU memory; the optimizer steps on CPU.
    `pin_memory`: pin them so host-device copies can overlap with compute."""

    pin_memory: bool = True


def adopt_policy(policy: Any) -> Any:
    """`policy` as ours if it is one of torch's fully_shard policies, else as it is."""
    ours = _OURS_BY_NAME.get(type(policy).__name__)
    if ours is None or isinstance(policy, ours) or not is_dataclass(policy):
        return policy
    return ours(**{f.name: getattr(policy, f.name) for f in fields(policy)})


_OURS_BY_NAME = {c.__name__: c for c in (MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy)}


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)
