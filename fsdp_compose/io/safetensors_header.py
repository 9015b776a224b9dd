"""The safetensors layout as whole checkpoints use it: dtype codes, file names, and headers
checked against their index and bytes (as the safetensors package checks them) before reading."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import NamedTuple

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
         torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
         torch.float8_e5m2: "F8_E5M2"}
DTYPES = {code: dtype for dtype, code in CODES.items()}
_MAX_HEADER = 100_000_000  # bytes: the safetensors package's own limit


class Saved(NamedTuple):
    """Where one tensor of a checkpoint is: its file, dtype code, shape, byte range."""

    file: str
    dtype: str
    shape: list[int]
    start: int  # absolute, in the file
    end: int


def read_headers(path: Path) -> dict[str, Saved]:
    """Every tensor of the checkpoint at `path`, by name. FileNotFoundError for a missing file;
    ValueError naming the file for a header or index that does not describe its bytes exactly."""
    files, weight_map = _checkpoint_files(path)
    saved: dict[str, Saved] = {}
    for file in files:
        for name, tensor in _read_header(file).items():
            if name in saved:
                raise _unreadable(file, f"tensor {name!r} is in {saved[name].file} too")
            saved[name] = tensor
    # Each tensor is in the file the index names, and no file holds others.
    if weight_map is not None:
        index = path / INDEX_FILE
        for name, file_name in weight_map.items():
            if name not in saved or Path(saved[name].file).name != file_name:
                raise _unreadable(index, f"it puts {name!r} in {path / file_name}, which does "
                                  "not hold it")
        if unlisted := [name for name in saved if name not in weight_map]:
            files_holding = sorted({saved[name].file for name in unlisted})
            raise _unreadable(index, f"it does not list {unlisted}, which {files_holding} hold")
    return saved


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    if not path.exists():
        raise FileNotFoundError(f"load_full_state_dict: {path} does not exist.")
    if not path.is_dir():
        return [path], None
    index = path / INDEX_FILE
    if not index.exists():
        if not (path / SINGLE_FILE).exists():
            raise FileNotFoundError(f"load_full_state_dict: {path} holds neither {SINGLE_FILE} "
                                    f"nor {INDEX_FILE}.")
        return [path / SINGLE_FILE], None
    try:
        # Bytes: a damaged file raises UnicodeDecodeError, a ValueError.
        parsed = json.loads(index.read_bytes())
    except ValueError as error:
        raise _unreadable(index, f"it is not JSON ({error})") from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    # Files beside the index, by plain name.
    if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and isinstance(file, str) and file not in ("", "..")
            and Path(file).name == file for name, file in weight_map.items()):
        raise _unreadable(index, 'it has no "weight_map" object mapping tensor names to file '
                          'names beside it')
    files = sorted({path / name for name in weight_map.values()})
    if absent := [file for file in files if not file.is_file()]:
        raise FileNotFoundError(f"load_full_state_dict: {index} names {absent[0].name}, but "
                                f"{absent[0]} does not exist.")
    return files, weight_map


def _read_header(file: Path) -> dict[str, Saved]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _unreadable(file, f"it is {size} bytes long, shorter than the 8-byte header "
                              "size that starts a safetensors file")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > size - 8:
            raise _unreadable(file, f"its header size ({header_size} bytes) runs past the end "
                              f"of the file ({size} bytes)")
        if header_size > _MAX_HEADER:
            raise _unreadable(file, f"its header size ({header_size} bytes) is over "
                              "safetensors' limit")
        try:
            header = json.loads(f.read(header_size).decode())
        except UnicodeDecodeError as error:  # a ValueError too
            raise _unreadable(file, f"its header is not UTF-8 text ({error})") from None
        except ValueError as error:
            raise _unreadable(file, f"its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise _unreadable(file, f"its header is a JSON {type(header).__name__}, not an object")
    if not isinstance(header.get("__metadata__", {}), dict):
        raise _unreadable(file, "its header's __metadata__ is not an object")
    ranges = {name: _byte_range(file, name, info)
              for name, info in header.items() if name != "__metadata__"}
    _check_layout(file, ranges, size - 8 - header_size)
    start = 8 + header_size
    return {n: Saved(str(file), header[n]["dtype"], header[n]["shape"], start + b, start + e)
            for n, (b, e) in ranges.items()}


def _byte_range(file: Path, name: str, info: object) -> tuple[int, int]:
    """Where tensor `name` is in the data, once its dtype and shape are checked to fill it."""
    keys = ("dtype", "shape", "data_offsets")
    if not isinstance(info, dict) or any(key not in info for key in keys):
        raise _unreadable(file, f"tensor {name!r} is {info!r}, not an object with keys "
                          f"{list(keys)}")
    dtype, shape, offsets = (info[key] for key in keys)
    if dtype not in DTYPES:
        raise _unreadable(file, f"tensor {name!r} has dtype {dtype!r}, not one of {sorted(DTYPES)}")
    if not _sizes(shape):
        raise _unreadable(file, f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (_sizes(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise _unreadable(file, f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _unreadable(file, f"tensor {name!r} of shape {shape} and dtype {dtype} takes "
                          f"{nbytes} bytes, but its data_offsets {offsets} hold "
                          f"{offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]


def _sizes(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)


def _check_layout(file: Path, ranges: dict[str, tuple[int, int]], data_size: int) -> None:
    """The byte ranges tile the data exactly (a file cut at a tensor boundary fails only here)."""
    end, previous = 0, None
    for name, (begin, stop) in sorted(ranges.items(), key=lambda item: item[1]):
        if begin > end:
            raise _unreadable(file, f"bytes {end}..{begin} of its data belong to no tensor")
        if begin < end:
            raise _unreadable(file, f"tensors {previous!r} and {name!r} overlap (bytes "
                              f"{begin}..{end} of its data)")
        end, previous = stop, name
    if end > data_size:
        raise _unreadable(file, f"its header describes {end - data_size} bytes more than the "
                          "file holds: it was cut short")
    if end < data_size:
        raise _unreadable(file, f"its last {data_size - end} bytes belong to no tensor")


def _unreadable(file: Path, fault: str) -> ValueError:
    return ValueError(f"load_full_state_dict: cannot read {file}: {fault}.")
