"""The first rank's side of save_full_state_dict: safetensors files written as their tensors
arrive, under staging names until every file is written, removed if anything fails."""

from __future__ import annotations

import errno
import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .first_rank import file_error
from .safetensors_header import CODES, INDEX_FILE, SINGLE_FILE

INCOMPLETE = ".incomplete"  # the suffix of a file or checkpoint being written

# (name, dtype, shape) of each tensor of a state dict, whole.
Entries = list[tuple[str, torch.dtype, tuple[int, ...]]]


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def plan_files(path: Path, entries: Entries, max_shard_size: int) -> list[tuple[Path, Entries]]:
    """The files to write and their entries: one, or as many as `max_shard_size` takes."""
    if path.suffix == ".safetensors":
        return [(path, entries)]
    groups: list[Entries] = [[]]
    size = 0
    for entry in entries:
        tensor_bytes = nbytes(*entry[1:])
        if size and size + tensor_bytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += tensor_bytes
    if len(groups) == 1:
        return [(path / SINGLE_FILE, groups[0])]
    return [(path / f"model-{i:05d}-of-{len(groups):05d}.safetensors", group)
            for i, group in enumerate(groups, 1)]


class _Writer:
    """One safetensors file, written under its staging name as its tensors arrive."""

    def __init__(self, path: Path, entries: Entries) -> None:
        self.path = path
        self.staging = path.with_name(path.name + INCOMPLETE)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in entries:
            offsets = [offset, offset := offset + nbytes(dtype, shape)]
            header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": offsets}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.file: BinaryIO = open(self.staging, "wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, tensor: torch.Tensor) -> None:
        # Through the buffer protocol: no copy of the bytes beyond the one on the CPU.
        self.file.write(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


class Saving:
    """The first rank's save, a file after another. A failure removes the staging files and
    raises an OSError naming the file (one while tensors stream in: from `next_file`)."""

    def __init__(self, path: Path, files: list[tuple[Path, Entries]]) -> None:
        self._path = path
        self._files = files
        self._writers: list[_Writer] = []  # the last one is open
        self._failed: Exception | None = None
        self._index_staging = path / (INDEX_FILE + INCOMPLETE)

    def start(self) -> None:
        """Refuse what open() would refuse late or unclearly; open the first file."""
        for file, _ in self._files:
            if file.is_dir():
                raise IsADirectoryError(errno.EISDIR, f"save_full_state_dict: cannot write {file}: "
                                        "it is a directory. Remove it, or pass a path without "
                                        ".safetensors to save into it.")
        first = self._files[0][0]
        above = next((p for p in first.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"save_full_state_dict: cannot write {first}: "
                                     f"{above} is a file, not a directory.")
        self._open_next()

    def write(self, tensor: torch.Tensor) -> None:
        if self._failed is None:  # else the rest of this file's tensors, gathered for nothing
            try:
                with self._failing(self._writers[-1].path):
                    self._writers[-1].write(tensor)
            except Exception as error:
                self._failed = error

    def next_file(self) -> None:
        """Close this file; open the next, or after the last rename all and write the index."""
        if self._failed is not None:
            raise self._failed
        with self._failing(self._writers[-1].path):
            self._writers[-1].file.close()
        if len(self._writers) < len(self._files):
            self._open_next()
            return
        for writer in self._writers:
            with self._failing(writer.path):
                writer.staging.replace(writer.path)
        if len(self._files) > 1:
            weight_map = {name: file.name for file, group in self._files for name, _, _ in group}
            total = sum(nbytes(*entry[1:]) for _, entries in self._files for entry in entries)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with self._failing(self._path / INDEX_FILE):
                self._index_staging.write_text(json.dumps(index, indent=2))
                self._index_staging.replace(self._path / INDEX_FILE)
        self._writers = []  # nothing left to discard

    def discard(self) -> None:
        """Remove the staging files (a full disk gets its space back); keep the others."""
        for writer in self._writers:
            with suppress(OSError):  # closing flushes, which may fail again: closed all the same
                writer.file.close()
            writer.staging.unlink(missing_ok=True)
        self._writers = []
        with suppress(OSError):  # no index, or a file where its folder goes
            self._index_staging.unlink(missing_ok=True)

    def _open_next(self) -> None:
        file, entries = self._files[len(self._writers)]
        with self._failing(file):
            file.parent.mkdir(parents=True, exist_ok=True)
            self._writers.append(_Writer(file, entries))

    @contextmanager
    def _failing(self, file: Path) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            self.discard()
            if isinstance(error, OSError):
                raise file_error(f"save_full_state_dict: cannot write {file}", error) from error
            raise
