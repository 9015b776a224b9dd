"""A sharded checkpoint's files, checked before anything is loaded: its metadata read with
an unpickler that accepts only checkpoint metadata classes, and every data file it names
present, as long as its byte ranges, and equal to the size and CRC-32 save_checkpoint
recorded for it. Each rank checks a share of the files; every rank raises the same fault."""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..comm.collectives import every_rank, is_first_rank

CHECKSUMS = ".checksums"  # JSON: each data file's size and CRC-32, written by save_checkpoint


def read_metadata(reader: MetadataCheckingReader) -> Metadata:
    try:
        return reader.read_metadata()
    except Exception as error:  # unpickling a damaged file raises almost any type
        file = Path(reader.path) / ".metadata"
        raise ValueError(
            f"load_checkpoint: {str(file)!r} is damaged or truncated ({type(error).__name__}: "
            f"{error}); nothing was loaded. Load another checkpoint."
        ) from error


def check_files(path: Path, metadata: Metadata) -> None:
    """Every data file the metadata names: present, as long as its byte ranges, and equal
    to its recorded CRC-32; each rank checks a share of them, every rank raises the first
    fault found (by file name)."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    recorded = _recorded_checksums(path)
    names = sorted(ends)
    rank, world = _rank_and_world()
    faults = [_file_fault(path / n, ends[n], recorded.get(n)) for n in names[rank::world]]
    found = [fault for fault in faults if fault is not None][:1]
    shares = every_rank(found)
    first = min((f for share in shares for f in share), key=str, default=None)
    if first is not None:
        raise first


def _file_fault(file: Path, end: int, recorded: dict[str, int] | None) -> Exception | None:
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return FileNotFoundError(
            f"load_checkpoint: {str(file)!r} is missing (the checkpoint's .metadata lists it); "
            "nothing was loaded. Load another checkpoint."
        )
    if size < end:
        return ValueError(
            f"load_checkpoint: {str(file)!r} is truncated: {size} bytes, where the checkpoint's "
            f".metadata places data up to byte {end}; nothing was loaded."
        )
    if recorded is not None and (size, _crc32(file)) != (recorded["size"], recorded["crc32"]):
        return ValueError(
            f"load_checkpoint: {str(file)!r} is damaged: its size or CRC-32 differs from the "
            f"one save_checkpoint recorded in {CHECKSUMS}; nothing was loaded."
        )
    return None


def write_checksums(folder: Path) -> None:
    """Each rank checksums a share of the data files just written; the first rank writes
    them all to CHECKSUMS."""
    names = sorted(f.name for f in folder.iterdir() if f.is_file() and not f.name.startswith("."))
    rank, world = _rank_and_world()
    mine = {n: {"size": (folder / n).stat().st_size, "crc32": _crc32(folder / n)}
            for n in names[rank::world]}
    everything: dict[str, dict[str, int]] = {}
    for share in every_rank(mine):
        everything.update(share)
    if is_first_rank():
        (folder / CHECKSUMS).write_text(json.dumps(everything, indent=1, sort_keys=True))


def _recorded_checksums(path: Path) -> dict[str, dict[str, int]]:
    """The checksums save_checkpoint recorded; none for a checkpoint saved otherwise."""
    try:
        recorded: dict[str, dict[str, int]] = json.loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        return {}
    except ValueError as error:
        raise ValueError(f"load_checkpoint: {str(path / CHECKSUMS)!r} is damaged ({error}).") from error
    return recorded


def _crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as stream:
        while chunk := stream.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return crc


def _rank_and_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles checkpoint metadata and nothing else: no arbitrary callables."""

    _ALLOWED = {
        ("torch", "Size"), ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or module == "torch.distributed.checkpoint.metadata":
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"load_checkpoint: the checkpoint metadata asks for {module}.{name}, which is not "
            "checkpoint metadata; refusing to unpickle it."
        )


class MetadataCheckingReader(FileSystemReader):
    """torch's file reader, with metadata read by `_MetadataUnpickler` (tensor data is read
    with torch.load(weights_only=True) already)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("load_checkpoint: .metadata holds no checkpoint metadata")
        storage_meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata
