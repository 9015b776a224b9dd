"""A sharded parameter's local tensor, handled so that the objects optimizers, modules and
tools hold stay the ones the model uses."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def zeroed_shard(local: torch.Tensor, numel: int, device: torch.device, pin: bool) -> torch.Tensor:
    """A flat zeroed shard of `numel` elements, of `local`'s class, on `device` (or meta)."""
    if local.is_meta or not is_traceable_wrapper_subclass(local):
        on = local.device if local.is_meta else device
        return torch.zeros(numel, dtype=local.dtype, device=on, pin_memory=pin and not local.is_meta)
    return local.new_zeros(numel)


def give_data(kept: nn.Parameter, new: nn.Parameter) -> None:
    """Give `kept` (the object optimizers hold) `new`'s data, in place."""
    # If only the local tensor differs, take it, as torch's fully_shard does: swap_tensors
    # refuses a tensor anything holds a weak reference to (torch's MemTracker does).
    if (kept.dtype, kept.device) == (new.dtype, new.device) and kept._spec == new._spec:  # type: ignore[attr-defined]
        kept._local_tensor = local_of(new)  # type: ignore[attr-defined]
        kept.requires_grad_(new.requires_grad)
        return
    grad = kept.grad  # swap_tensors would move it to the discarded tensor: kept if it fits
    torch.utils.swap_tensors(kept, new)
    if grad is not None and (grad.shape, grad.dtype) == (kept.shape, kept.dtype):
        kept.grad = grad


def local_of(dtensor: torch.Tensor) -> torch.Tensor:
    """The local tensor itself (to_local() makes a view): identity tells our shard from another."""
    local: torch.Tensor = dtensor._local_tensor  # type: ignore[attr-defined]
    return local
