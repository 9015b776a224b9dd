"""Whole checkpoints in Hugging Face's safetensors layout, streamed one tensor at a time, so
no rank ever holds the whole model: saving gathers a tensor, the first rank writes it and
every rank frees it before the next; loading has the first rank read a tensor and send it,
and every rank keep its shard.

The header (see io/safetensors_header.py) needs only shapes and dtypes, which the sharded
state dict knows without gathering: it is written first and the bytes follow as they are
gathered. Past `max_shard_size` bytes the tensors go to several files,
`model-0000i-of-0000n.safetensors`, with `model.safetensors.index.json` mapping each name
to its file, as `save_pretrained` writes them.

Only the first rank touches the files, so only it sees what is wrong with them (a damaged
header, a full disk). It shares its verdict (see io/first_rank.py) before any tensor moves,
once each file is written and before each batch is loaded, and every rank raises the
same error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm.collectives import broadcast, is_first_rank
from .first_rank import file_error, from_first_rank
from .safetensors_header import DTYPES, Saved, read_headers
from .safetensors_writer import (
    INCOMPLETE as INCOMPLETE,  # save_checkpoint's staging suffix
)
from .safetensors_writer import Entries, Saving, plan_files

_LOAD_BATCH = 64 * 1024**2  # bytes of whole tensors a rank holds before loading them


def save_full_state_dict(
    model: nn.Module, path: str | os.PathLike[str], *, max_shard_size: int = 5 * 1024**3
) -> None:
    """Write `model`'s whole state dict (parameters and persistent buffers, under the names
    `state_dict()` gives them: a Hugging Face model's own) as safetensors, from the first
    rank. `path` is a directory (`model.safetensors`, or several files and an index past
    `max_shard_size` bytes, as `save_pretrained` writes them) or a file name ending in
    `.safetensors` (one file). Tensors are gathered and written one at a time: the first
    rank holds at most one whole tensor beyond its shards. Call on every rank.

    Each file is written as `<name>.incomplete` and takes its name once all are written. If
    the first rank cannot write (a directory where the file goes, no permission, a full
    disk), it removes what it wrote, files already at `path` stay as they were, and every
    rank raises the same OSError naming the file."""
    state = _tensors(model, "save_full_state_dict")  # sharded DTensors: nothing gathered yet
    entries: Entries = [(k, t.dtype, tuple(t.shape)) for k, t in state.items()]
    files = plan_files(Path(path), entries, max_shard_size)
    saving = Saving(Path(path), files) if is_first_rank() else None
    try:
        from_first_rank(saving.start if saving is not None else None)  # before any tensor is gathered
        for _, file_entries in files:
            for name, _, _ in file_entries:  # in state-dict order, as the header lists them
                whole = _whole(state[name])  # every rank takes part in the gather
                if saving is not None:
                    saving.write(whole)
                del whole
            from_first_rank(saving.next_file if saving is not None else None)
    except BaseException:
        if saving is not None:
            saving.discard()  # an error raised here, or a gather that failed
        raise


def load_full_state_dict(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load a safetensors checkpoint (a file, or a directory holding `model.safetensors` or
    an index and its files) into `model`, whose parameters may be sharded: the first rank
    reads one tensor at a time and sends it to every rank, which keeps its shard (loaded
    every `_LOAD_BATCH` bytes). A missing or damaged checkpoint (a file cut short, a header
    that does not describe its bytes, an index that does not describe its files), missing
    or unexpected names and mismatched shapes raise the same error on every rank before any
    tensor is sent. Call on every rank."""
    state = _tensors(model, "load_full_state_dict")
    saved = from_first_rank((lambda: read_headers(Path(path))) if is_first_rank() else None)
    _check_matches(Path(path), saved, state)
    reader = _Reader() if is_first_rank() else None
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for name, target in state.items():
        entry = saved[name]
        whole = reader.read(name, entry) if reader is not None else None
        whole = _broadcast(whole, DTYPES[entry.dtype], tuple(entry.shape), _device_of(target))
        batch[name] = whole.to(target.dtype)
        size += batch[name].nbytes
        if size >= _LOAD_BATCH:
            _load_batch(model, batch, reader)
            batch, size = {}, 0
    _load_batch(model, batch, reader)


def _tensors(model: nn.Module, caller: str) -> dict[str, torch.Tensor]:
    """The model's state dict, refused (on every rank alike) if it holds anything but
    tensors (a module's extra state), which safetensors cannot store."""
    state = model.state_dict()
    if others := [k for k, v in state.items() if not isinstance(v, torch.Tensor)]:
        raise ValueError(
            f"{caller}: {others} are not tensors (a module's extra state); safetensors stores "
            "tensors only. Save such models with save_checkpoint."
        )
    return state


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, where it is (a DTensor gathered: a collective)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach()


def _device_of(tensor: torch.Tensor) -> torch.device:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.device


def _broadcast(
    whole: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """The first rank's `whole`, on every rank (on `device`, where the process group sends)."""
    if not dist.is_initialized():
        assert whole is not None
        return whole
    tensor = whole.to(device) if whole is not None else torch.empty(shape, dtype=dtype, device=device)
    group = dist.group.WORLD
    assert group is not None  # initialized
    broadcast(tensor, group)
    return tensor


def _check_matches(
    path: Path, saved: dict[str, Saved], state: dict[str, Any]
) -> None:
    missing = [k for k in state if k not in saved]
    unexpected = [k for k in saved if k not in state]
    shapes = [
        f"{k!r}: checkpoint {tuple(saved[k].shape)}, model {tuple(t.shape)}"
        for k, t in state.items() if k in saved and tuple(saved[k].shape) != tuple(t.shape)
    ]
    if missing or unexpected or shapes:
        problems = [
            f"{label}: {items}" for label, items in (
                ("missing", missing), ("unexpected", unexpected), ("shape mismatches", shapes),
            ) if items
        ]
        raise ValueError(
            f"load_full_state_dict: the checkpoint at {path} does not match the model: "
            + "; ".join(problems)
        )


class _Reader:
    """The first rank's reads. One that fails (the disk, or a file changed since its header
    was checked) sends zeros instead, as the other ranks wait for a tensor, and is raised
    by `check` before the batch is loaded."""

    def __init__(self) -> None:
        self._failed: Exception | None = None

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


def _load_batch(model: nn.Module, batch: dict[str, torch.Tensor], reader: _Reader | None) -> None:
    """Load whole tensors (each rank keeps its shard), unless the first rank failed to
    read one of them: then every rank raises its error."""
    from_first_rank(reader.check if reader is not None else None)
    model.load_state_dict(batch, strict=False)


def _read(name: str, entry: Saved) -> torch.Tensor:
    """One tensor, read from its file on its own."""
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        data = bytearray(f.read(entry.end - entry.start))
    if len(data) != entry.end - entry.start:
        raise ValueError(
            f"load_full_state_dict: cannot read {entry.file}: it ends within {name!r} (bytes "
            f"{entry.start}..{entry.end}), cut short since its header was checked."
        )
    dtype = DTYPES[entry.dtype]
    if not data:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(entry.shape)
