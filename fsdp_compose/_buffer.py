"""A communication buffer reused from one collective to the next."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch


class ReusedBuffer:
    """One tensor (the rows of a collective) whose storage exists only between `take` and
    `release`.

    A unit gathers and reduces the same sizes at every step; resizing one tensor's storage
    costs a fraction of constructing a new tensor, and freeing it after each use keeps the
    memory what fresh buffers would take.
    """

    __slots__ = ("_nbytes", "_spec", "_storage", "_tensor", "flat")  # (nbytes: a method)
    flat: torch.Tensor  # the taken tensor, 1-D (a view, made once): set by the first take

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None
        # Kept beside the tensor: reading them from it costs more than the resize.
        self._storage: torch.UntypedStorage | None = None
        self._nbytes = 0
        self._spec: tuple[tuple[int, int], torch.dtype, torch.device] | None = None

    def take(
        self, spec: tuple[tuple[int, int], torch.dtype, torch.device]
    ) -> torch.Tensor:
        """A contiguous tensor of `spec` (shape: rows of a collective; dtype; device),
        uninitialised, until `release`. Callers pass the same spec object each time when
        they can: it is checked by identity first, which costs less than comparing."""
        if spec is not self._spec and spec != self._spec:
            shape, dtype, device = spec
            # Not an inference tensor, whichever mode the first use runs in.
            with torch.inference_mode(False):
                tensor = self._tensor = torch.empty(shape, dtype=dtype, device=device)
            self.flat = tensor.view(-1)
            self._storage, self._nbytes = tensor.untyped_storage(), tensor.nbytes
            self._spec = spec
            return tensor
        if TYPE_CHECKING:  # set with the spec; checked for mypy only (a cast costs a call here)
            assert self._storage is not None and self._tensor is not None
        self._storage.resize_(self._nbytes)
        return self._tensor

    def nbytes(self) -> int:
        """What its storage holds now (0 when released)."""
        return 0 if self._storage is None else self._storage.nbytes()

    def release(self) -> None:
        """Free the storage; what `take` returned must no longer be in use."""
        if self._storage is not None:
            self._storage.resize_(0)
