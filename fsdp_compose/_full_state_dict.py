"""Whole checkpoints in Hugging Face's safetensors layout, streamed one tensor at a time, so
no rank ever holds the whole model: saving gathers a tensor, the first rank writes it and
every rank frees it before the next; loading has the first rank read a tensor and send it,
and every rank keep its shard.

A safetensors file is an 8-byte little-endian header size, a JSON header naming each
tensor's dtype, shape and byte range, and the bytes. The header needs only shapes and
dtypes, which the sharded state dict knows without gathering: it is written first and the
bytes follow as they are gathered. Past `max_shard_size` bytes the tensors go to several
files, `model-0000i-of-0000n.safetensors`, with `model.safetensors.index.json` mapping each
name to its file, as `save_pretrained` writes them.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ._collectives import is_first_rank

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
INCOMPLETE = ".incomplete"  # the suffix of a file or checkpoint being written
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_LOAD_BATCH = 64 * 1024**2  # bytes of whole tensors a rank holds before loading them

# (name, dtype, shape) of each tensor of a state dict, whole.
Entries = list[tuple[str, torch.dtype, tuple[int, ...]]]


def save_full_state_dict(
    model: nn.Module, path: str | os.PathLike[str], *, max_shard_size: int = 5 * 1024**3
) -> None:
    """Write `model`'s whole state dict (parameters and persistent buffers, under the names
    `state_dict()` gives them: a Hugging Face model's own) as safetensors, from the first
    rank. `path` is a directory (`model.safetensors`, or several files and an index past
    `max_shard_size` bytes, as `save_pretrained` writes them) or a file name ending in
    `.safetensors` (one file). Tensors are gathered and written one at a time: the first
    rank holds at most one whole tensor beyond its shards. Call on every rank."""
    state = _tensors(model, "save_full_state_dict")  # sharded DTensors: nothing gathered yet
    entries: Entries = [(k, t.dtype, tuple(t.shape)) for k, t in state.items()]
    writing = is_first_rank()
    files = _plan_files(Path(path), entries, max_shard_size)
    for file, file_entries in files:
        writer = _Writer(file, file_entries) if writing else None
        for name, _, _ in file_entries:  # in state-dict order, as the header lists them
            whole = _whole(state[name])  # every rank takes part in the gather
            if writer is not None:
                writer.write(whole)
            del whole
        if writer is not None:
            writer.close()
    if writing and len(files) > 1:
        _write_index(Path(path), files)


def load_full_state_dict(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load a safetensors checkpoint (a file, or a directory holding `model.safetensors` or
    an index and its files) into `model`, whose parameters may be sharded: the first rank
    reads one tensor at a time and sends it to every rank, which keeps its shard (loaded
    every `_LOAD_BATCH` bytes). Missing or unexpected names and mismatched shapes raise the
    same error on every rank before any tensor is sent. Call on every rank."""
    state = _tensors(model, "load_full_state_dict")
    saved = _headers(Path(path)) if is_first_rank() else None
    if dist.is_initialized():
        shared = [saved]
        dist.broadcast_object_list(shared, src=0)  # the headers, so every rank checks
        saved = shared[0]
    assert saved is not None
    _check_matches(Path(path), saved, state)
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for name, target in state.items():
        entry = saved[name]
        whole = _read(entry) if is_first_rank() else None
        whole = _broadcast(whole, _DTYPES[entry.dtype], tuple(entry.shape), _device_of(target))
        batch[name] = whole.to(target.dtype)
        size += batch[name].nbytes
        if size >= _LOAD_BATCH:
            model.load_state_dict(batch, strict=False)  # whole tensors: each rank keeps its shard
            batch, size = {}, 0
    model.load_state_dict(batch, strict=False)


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
    dist.broadcast(tensor, src=0)
    return tensor


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _plan_files(path: Path, entries: Entries, max_shard_size: int) -> list[tuple[Path, Entries]]:
    """The files to write and the entries of each, in state-dict order: one file when
    `path` names one or everything fits `max_shard_size`, else as many as it takes."""
    if path.suffix == ".safetensors":
        return [(path, entries)]
    groups: list[Entries] = [[]]
    size = 0
    for entry in entries:
        _, dtype, shape = entry
        nbytes = _nbytes(dtype, shape)
        if size and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    if len(groups) == 1:
        return [(path / SINGLE_FILE, groups[0])]
    n = len(groups)
    return [(path / f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


class _Writer:
    """One safetensors file, written as its tensors arrive (in header order), under a
    staging name until complete."""

    def __init__(self, path: Path, entries: Entries) -> None:
        self._path = path
        self._staging = path.with_name(path.name + INCOMPLETE)
        path.parent.mkdir(parents=True, exist_ok=True)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in entries:
            nbytes = _nbytes(dtype, shape)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self._file: BinaryIO = open(self._staging, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, tensor: torch.Tensor) -> None:
        # The tensor's own bytes, through the buffer protocol: no copy of them on the CPU
        # (only the writing rank brings a tensor there).
        self._file.write(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        self._file.close()
        self._staging.replace(self._path)


def _write_index(path: Path, files: list[tuple[Path, Entries]]) -> None:
    weight_map = {name: file.name for file, entries in files for name, _, _ in entries}
    total = sum(_nbytes(dtype, shape) for _, entries in files for _, dtype, shape in entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    staging = path / (INDEX_FILE + INCOMPLETE)
    staging.write_text(json.dumps(index, indent=2))
    staging.replace(path / INDEX_FILE)


class _Saved(NamedTuple):
    """Where one tensor of a checkpoint is: its file, dtype code, shape, byte range."""

    file: str
    dtype: str
    shape: list[int]
    start: int  # absolute, in the file
    end: int


def _headers(path: Path) -> dict[str, _Saved]:
    """Every tensor of the checkpoint at `path`, by name."""
    if path.is_dir():
        if (path / INDEX_FILE).exists():
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        else:
            files = [path / SINGLE_FILE]
    else:
        files = [path]
    saved = {}
    for file in files:
        if not file.exists():
            raise FileNotFoundError(f"load_full_state_dict: {file} does not exist.")
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                saved[name] = _Saved(str(file), info["dtype"], info["shape"], 8 + size + begin, 8 + size + end)
    return saved


def _check_matches(
    path: Path, saved: dict[str, _Saved], state: dict[str, Any]
) -> None:
    missing = [k for k in state if k not in saved]
    unexpected = [k for k in saved if k not in state]
    shapes = [
        f"{k!r}: checkpoint {tuple(saved[k].shape)}, model {tuple(t.shape)}"
        for k, t in state.items() if k in saved and tuple(saved[k].shape) != tuple(t.shape)
    ]
    dtypes = [f"{k!r}: {saved[k].dtype}" for k in state if k in saved and saved[k].dtype not in _DTYPES]
    if missing or unexpected or shapes or dtypes:
        problems = [
            f"{label}: {items}" for label, items in (
                ("missing", missing), ("unexpected", unexpected), ("shape mismatches", shapes),
                ("unsupported dtypes", dtypes),
            ) if items
        ]
        raise ValueError(
            f"load_full_state_dict: the checkpoint at {path} does not match the model: "
            + "; ".join(problems)
        )


def _read(entry: _Saved) -> torch.Tensor:
    """One tensor, read from its file on its own."""
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        data = bytearray(f.read(entry.end - entry.start))
    dtype = _DTYPES[entry.dtype]
    if not data:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(entry.shape)
