"""MixedPrecisionPolicy, OffloadPolicy and CPUOffloadPolicy: what a unit stores and computes in."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of a unit's unsharded parameters, gradient reduction and outputs.

    `param_dtype`: dtype of the unsharded parameters (all-gather and compute); None keeps
    the original. `reduce_dtype`: dtype of the gradient reduction; None follows
    `param_dtype`. `output_dtype`: cast floating-point outputs to it; None leaves them.
    `cast_forward_inputs`: cast floating-point forward inputs to `param_dtype`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep sharded parameters and gradients where the mesh is (no offload)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in CPU memory; the optimizer steps on CPU.

    `pin_memory`: pin the CPU copies so host-device copies can overlap with compute.
    """

    pin_memory: bool = True
