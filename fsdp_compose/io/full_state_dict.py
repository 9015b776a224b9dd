"""Whole checkpoints in Hugging Face's safetensors layout, streamed a unit at a time so no
rank holds the whole model. Only the first rank touches the files (see io/first_rank.py)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm.collectives import broadcast, is_first_rank
from .first_rank import file_error, from_first_rank
from .safetensors_header import DTYPES, Saved, read_headers
from .safetensors_writer import Entries, Saving, plan_files
from .whole_weights import full_state_dict_order, iter_full_state_dict, load_whole_items, mismatches

_LOAD_BATCH = 64 * 1024**2  # bytes of whole tensors a rank holds before loading them


def save_full_state_dict(model: nn.Module, path: str | os.PathLike[str], *,
                         max_shard_size: int = 5 * 1024**3) -> None:
    """Write `model`'s whole state dict as safetensors from the first rank; call on every rank.
    A rank holds one unit's gathered bytes and one whole tensor beyond its shards. `path`: a
    `.safetensors` file or a directory (one file, or past `max_shard_size` several and an index,
    as `save_pretrained` writes them). All or nothing: files at `path` stay as they were and
    every rank raises the same OSError if one cannot be written."""
    state = _tensors(model, "save_full_state_dict")  # sharded DTensors: nothing gathered yet
    order = [name for part, names in full_state_dict_order(model)
             for name in (names if part is None else itertools.chain.from_iterable(names))]
    entries: Entries = [(k, state[k].dtype, tuple(state[k].shape)) for k in order]
    files = plan_files(Path(path), entries, max_shard_size)
    saving = Saving(Path(path), files) if is_first_rank() else None
    try:
        from_first_rank(saving.start if saving is not None else None)
        wholes = iter_full_state_dict(model)  # in `order`
        for _, file_entries in files:
            for _, whole in itertools.islice(wholes, len(file_entries)):
                if saving is not None:
                    saving.write(whole)
                del whole  # before the next gather
            from_first_rank(saving.next_file if saving is not None else None)
    except BaseException:
        if saving is not None:
            saving.discard()
        raise


def load_full_state_dict(model: nn.Module,
                         path: str | os.PathLike[str] | Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load a safetensors file, or a directory holding `model.safetensors` or an index and its
    files, into `model`; call on every rank. A damaged checkpoint or a mismatch raises the same
    error on every rank before any tensor is sent. `path` may instead be whole `(name, tensor)`
    pairs, the same on every rank (another model's `iter_full_state_dict`)."""
    if not isinstance(path, (str, os.PathLike)):
        load_whole_items(model, path)
        return
    state = _tensors(model, "load_full_state_dict")
    saved = from_first_rank((lambda: read_headers(Path(path))) if is_first_rank() else None)
    if problems := mismatches({k: tuple(s.shape) for k, s in saved.items()}, state):
        raise ValueError(f"load_full_state_dict: the checkpoint at {Path(path)} does not match "
                         f"the model: {problems}")
    reader = _Reader() if is_first_rank() else None
    batch: dict[str, torch.Tensor] = {}
    last = next(reversed(state), None)
    for name, target in state.items():
        entry = saved[name]
        device = target.to_local().device if isinstance(target, DTensor) else target.device
        whole = reader.read(name, entry).to(device) if reader is not None else torch.empty(
            entry.shape, dtype=DTYPES[entry.dtype], device=device)
        # The first rank's, on every rank (on `device`: the group sends there).
        if dist.is_initialized():
            broadcast(whole, dist.group.WORLD)  # type: ignore[arg-type]  # set once initialized
        batch[name] = whole.to(target.dtype)
        if name == last or sum(t.nbytes for t in batch.values()) >= _LOAD_BATCH:
            # Unless the first rank failed to read one; each rank keeps its shard.
            from_first_rank(reader.check if reader is not None else None)
            model.load_state_dict(batch, strict=False)
            batch = {}


def _tensors(model: nn.Module, caller: str) -> dict[str, torch.Tensor]:
    """The model's state dict, refused if it holds anything safetensors cannot store."""
    state = model.state_dict()
    if others := [k for k, v in state.items() if not isinstance(v, torch.Tensor)]:
        raise ValueError(f"{caller}: {others} are not tensors (a module's extra state); "
                         "safetensors stores tensors only. Save such models with save_checkpoint.")
    return state


class _Reader:
    """The first rank's reads; after a failure, zeros (others wait for them) until `check`."""

    _failed: Exception | None = None

    def read(self, name: str, entry: Saved) -> torch.Tensor:
        if self._failed is None:
            try:
                return _read(name, entry)
            except OSError as error:
                self._failed = file_error(f"load_full_state_dict: cannot read {entry.file}", error)
            except Exception as error:
                self._failed = error
        return torch.zeros(entry.shape, dtype=DTYPES[entry.dtype])

    def check(self) -> None:
        if self._failed is not None:
            raise self._failed


def _read(name: str, entry: Saved) -> torch.Tensor:
    tensor = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        # Through the buffer protocol: the bytes go straight into the tensor.
        if f.readinto(tensor.view(-1).view(torch.uint8).numpy().data) != entry.end - entry.start:
            raise ValueError(f"load_full_state_dict: cannot read {entry.file}: it ends within "
                             f"{name!r} (bytes {entry.start}..{entry.end}), cut short since its "
                             "header was checked.")
    return tensor
