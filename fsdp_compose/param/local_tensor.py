"""A sharded parameter's local tensor, handled so that the objects optimizers, modules and
tools hold stay the ones the model uses: read as itself, given new data in place, and
allocated as the subclass it is."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def zeroed_shard(local: torch.Tensor, numel: int, device: torch.device, pin: bool) -> torch.Tensor:
    """A flat zeroed shard of `numel` elements for `local` on `device` (meta stays meta); a
    tensor subclass (with all-gather hooks: checked) keeps its class."""
    if local.is_meta or not is_traceable_wrapper_subclass(local):
        on = local.device if local.is_meta else device
        return torch.zeros(numel, dtype=local.dtype, device=on, pin_memory=pin and not local.is_meta)
    return local.new_zeros(numel)


def give_data(kept: nn.Parameter, new: nn.Parameter) -> None:
    """Give `kept` (the object optimizers, modules and tools hold) the data of `new`.

    When only the local tensor differs (same dtype, device and DTensor spec: a shard moved
    into the flat shard, or values stored anew), by making new's local tensor kept's, as
    torch's fully_shard does: swap_tensors refuses a tensor that anything holds a weak
    reference to (torch's MemTracker does, for every parameter it saw). Else (a dtype or
    device changed, e.g. from the meta device) by swap_tensors, keeping `.grad` where it
    still fits: swap_tensors would move it to the discarded tensor."""
    if (kept.dtype, kept.device) == (new.dtype, new.device) and kept._spec == new._spec:  # type: ignore[attr-defined]
        kept._local_tensor = local_of(new)  # type: ignore[attr-defined]
        kept.requires_grad_(new.requires_grad)
        return
    grad = kept.grad
    torch.utils.swap_tensors(kept, new)
    if grad is not None and (grad.shape, grad.dtype) == (kept.shape, kept.dtype):
        kept.grad = grad


def local_of(dtensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (or a Parameter holding one) itself: to_local() of a
    Parameter returns a fresh view, and identity is how we tell our shard from one that
    replaced it."""
    local: torch.Tensor = dtensor._local_tensor  # type: ignore[attr-defined]
    return local
