"""A sharded checkpoint's files, checked before anything is loaded: .metadata by an unpickler
that accepts only checkpoint metadata, data files by length and the recorded size and CRC-32."""

from __future__ import annotations

import json
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..comm.collectives import every_rank

CHECKSUMS = ".checksums"  # JSON: each data file's size and CRC-32, written by save_checkpoint
T = TypeVar("T")


def check_files(path: Path, metadata: Metadata) -> None:
    """Raise on every rank the first fault (by name) of the files: missing, short or damaged."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    try:
        recorded: dict[str, dict[str, int]] = json.loads((path / CHECKSUMS).read_text())
        if not isinstance(recorded, dict) or not all(
            isinstance(sums, dict) and all(isinstance(sums.get(k), int) for k in ("size", "crc32"))
            for sums in recorded.values()
        ):
            raise ValueError("not a size and CRC-32 per file")
    except FileNotFoundError:
        recorded = {}  # a checkpoint saved otherwise
    except ValueError as error:
        raise ValueError(f"load_checkpoint: {str(path / CHECKSUMS)!r} is damaged ({error}); "
                         "nothing was loaded. Load another checkpoint.") from error
    names = sorted(set(ends) | set(recorded))  # and the files beside DCP's (resume_state.py)
    faults = _shared(names, lambda n: _file_fault(path / n, ends.get(n, 0), recorded.get(n)))
    if found := sorted((f for f in faults.values() if f is not None), key=str):
        raise found[0]


def _file_fault(file: Path, end: int, recorded: dict[str, int] | None) -> Exception | None:
    where = f"load_checkpoint: {str(file)!r}"
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return FileNotFoundError(f"{where} is missing (the checkpoint's .metadata or {CHECKSUMS} "
                                 "lists it); nothing was loaded. Load another checkpoint.")
    if size < end:
        return ValueError(f"{where} is truncated: {size} bytes, where the checkpoint's .metadata "
                          f"places data up to byte {end}; nothing was loaded.")
    if recorded is not None and (size, _crc32(file)) != (recorded["size"], recorded["crc32"]):
        return ValueError(f"{where} is damaged: its size or CRC-32 differs from the one "
                          f"save_checkpoint recorded in {CHECKSUMS}; nothing was loaded.")
    return None


def checksums(folder: Path) -> str:
    """Each data file's size and CRC-32, as CHECKSUMS holds them (each rank reads a share)."""
    names = sorted(f.name for f in folder.iterdir() if f.is_file() and not f.name.startswith("."))
    sums = _shared(names, lambda n: {"size": (folder / n).stat().st_size,
                                     "crc32": _crc32(folder / n)})
    return json.dumps(sums, indent=1, sort_keys=True)


def _shared(names: list[str], work: Callable[[str], T]) -> dict[str, T]:
    """`work(name)` for every name, each rank doing a share; the same dict on every rank."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return {name: done for share in every_rank({n: work(n) for n in names[rank::world]})
            for name, done in share.items()}


def _crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as stream:
        while chunk := stream.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return crc


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles checkpoint metadata and nothing else: no arbitrary callables."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module == "pathlib._local":  # where Python 3.13 pickles paths; pathlib has them all
            module = "pathlib"
        if (module, name) in self._ALLOWED or module == "torch.distributed.checkpoint.metadata":
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"the checkpoint metadata asks for {module}.{name}, which "
                                     "is not checkpoint metadata; refusing to unpickle it.")


class MetadataCheckingReader(FileSystemReader):
    """torch's reader (tensor data: weights_only already), its metadata by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = Path(self.path) / ".metadata"
        try:
            with open(file, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(".metadata holds no checkpoint metadata")
        except Exception as error:  # unpickling a damaged file raises almost any type
            raise ValueError(f"load_checkpoint: {str(file)!r} is damaged or truncated "
                             f"({type(error).__name__}: {error}); nothing was loaded. Load another "
                             "checkpoint.") from error
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        metadata.storage_meta = storage_meta
        return metadata
