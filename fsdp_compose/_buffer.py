"""A communication buffer reused from one collective to the next."""

from __future__ import annotations

import torch


class ReusedBuffer:
    """One flat tensor whose storage exists only between `take` and `release`.

    A unit gathers and reduces the same sizes at every step; resizing one tensor's storage
    costs a fraction of constructing a new tensor, and freeing it after each use keeps the
    memory what fresh buffers would take.
    """

    __slots__ = ("_tensor",)

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `numel` elements, uninitialised, until `release`."""
        tensor = self._tensor
        if tensor is None or tensor.numel() != numel or tensor.dtype != dtype or (
            tensor.device != device
        ):
            # Not an inference tensor, whichever mode the first use runs in.
            with torch.inference_mode(False):
                tensor = self._tensor = torch.empty(numel, dtype=dtype, device=device)
        else:
            tensor.untyped_storage().resize_(numel * tensor.element_size())
        return tensor

    def release(self) -> None:
        """Free the storage; what `take` returned must no longer be in use."""
        if self._tensor is not None:
            self._tensor.untyped_storage().resize_(0)
