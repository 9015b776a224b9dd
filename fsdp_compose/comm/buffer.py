"""A communication buffer reused from one collective to the next."""

from __future__ import annotations

import torch


class ReusedBuffer:
    """One tensor (the rows of a collective) whose storage exists only between `take` and
    `release`.

    A unit gathers and reduces the same sizes at every step; resizing one tensor's storage
    is cheaper than constructing a new tensor, and freeing it after each use keeps the
    memory what fresh buffers would take.
    """

    __slots__ = ("_nbytes", "_spec", "_taken", "flat")
    flat: torch.Tensor  # the taken tensor, 1-D (a view, made once): set by the first take

    def __init__(self) -> None:
        # The tensor and its storage, kept together once made.
        self._taken: tuple[torch.Tensor, torch.UntypedStorage] | None = None
        self._nbytes = 0
        self._spec: tuple[tuple[int, int], torch.dtype, torch.device] | None = None

    def take(
        self, spec: tuple[tuple[int, int], torch.dtype, torch.device]
    ) -> torch.Tensor:
        """A contiguous tensor of `spec` (shape: rows of a collective; dtype; device),
        uninitialised, until `release`. Callers pass the same spec object each time when
        they can: it is checked by identity first."""
        if self._taken is None or (spec is not self._spec and spec != self._spec):
            shape, dtype, device = spec
            # Not an inference tensor, whichever mode the first use runs in.
            with torch.inference_mode(False):
                tensor = torch.empty(shape, dtype=dtype, device=device)
            self.flat = tensor.view(-1)
            self._taken = tensor, tensor.untyped_storage()
            self._nbytes, self._spec = tensor.nbytes, spec
            return tensor
        tensor, storage = self._taken
        storage.resize_(self._nbytes)
        return tensor

    def nbytes(self) -> int:
        """What its storage holds now (0 when released)."""
        return 0 if self._taken is None else self._taken[1].nbytes()

    def release(self) -> None:
        """Free the storage; what `take` returned must no longer be in use."""
        if self._taken is not None:
            self._taken[1].resize_(0)
