"""Damaged copies of good safetensors checkpoints, one per fault, each with the error that
load_full_state_dict raises for it (class name and exact message)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any, NamedTuple

CODES = ["BF16", "BOOL", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "I16", "I32", "I64", "I8", "U8"]


class Damage(NamedTuple):
    name: str
    path: Path  # what to load
    error: tuple[str, str]  # what every rank raises: class name, message


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header and data."""
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def join(header: dict[str, Any], data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def with_raw_header(data: bytes, raw: bytes) -> bytes:
    """`data` with its header replaced by `raw`, padded with spaces to the same size."""
    (size,) = struct.unpack("<Q", data[:8])
    return data[:8] + raw.ljust(size) + data[8 + size :]


def damaged_files(good: Path, folder: Path) -> list[Damage]:
    """Copies of the one-file checkpoint `good`, each damaged in one way, in `folder`."""
    data = good.read_bytes()
    header, body = split(data)
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    by_offset = sorted((info["data_offsets"], name) for name, info in tensors.items())
    first_range, first = by_offset[0]
    previous = by_offset[-2][1]
    (begin, end), last = by_offset[-1]

    def edited(edit: Any) -> bytes:
        copy = json.loads(json.dumps(header))
        edit(copy)
        return join(copy, body)

    def shift_last(by: int) -> Any:
        return lambda h: h[last].update(data_offsets=[begin + by, end + by])

    missing_key = {"dtype": header[first]["dtype"], "shape": header[first]["shape"]}
    shape = [*header[first]["shape"][:-1], header[first]["shape"][-1] - 1]
    shape_bytes = 4 * shape[0] * shape[1]
    cases = {  # name: (bytes, class, fault)
        "cut at a tensor boundary": (data[: len(data) - len(body) + begin], "ValueError",
            f"its header describes {end - begin} bytes more than the file holds: it was cut short"),
        "cut within a tensor": (data[:-3], "ValueError",
            "its header describes 3 bytes more than the file holds: it was cut short"),
        "trailing bytes": (data + bytes(8), "ValueError", "its last 8 bytes belong to no tensor"),
        "shorter than the size prefix": (data[:5], "ValueError",
            "it is 5 bytes long, shorter than the 8-byte header size that starts a "
            "safetensors file"),
        "header size past the end": (struct.pack("<Q", len(data)) + data[8:], "ValueError",
            f"its header size ({len(data)} bytes) runs past the end of the file "
            f"({len(data)} bytes)"),
        "header not JSON": (with_raw_header(data, b"not json"), "ValueError",
            "its header is not JSON (Expecting value: line 1 column 1 (char 0))"),
        "header not UTF-8": (with_raw_header(data, b'{"\xff": 1}'), "ValueError",
            "its header is not UTF-8 text ('utf-8' codec can't decode byte 0xff in position 2: "
            "invalid start byte)"),
        "header a list": (with_raw_header(data, b"[]"), "ValueError",
            "its header is a JSON list, not an object"),
        "entry without offsets": (edited(lambda h: h[first].pop("data_offsets")), "ValueError",
            f"tensor {first!r} is {missing_key!r}, not an object with keys "
            "['dtype', 'shape', 'data_offsets']"),
        "unknown dtype": (edited(lambda h: h[first].update(dtype="F99")), "ValueError",
            f"tensor {first!r} has dtype 'F99', not one of {CODES}"),
        "gap": (edited(shift_last(8)), "ValueError",
            f"bytes {begin}..{begin + 8} of its data belong to no tensor"),
        "overlap": (edited(shift_last(-4)), "ValueError",
            f"tensors {previous!r} and {last!r} overlap (bytes {begin - 4}..{begin} of its data)"),
        "shape not its bytes": (edited(lambda h: h[first].update(shape=shape)), "ValueError",
            f"tensor {first!r} of shape {shape} and dtype F32 takes {shape_bytes} bytes, but its "
            f"data_offsets {first_range} hold {first_range[1] - first_range[0]}"),
    }
    damages = []
    for i, (name, (damaged, error, fault)) in enumerate(cases.items()):
        path = folder / f"damaged-{i}.safetensors"
        path.write_bytes(damaged)
        message = f"load_full_state_dict: cannot read {path}: {fault}."
        damages.append(Damage(name, path, (error, message)))
    return damages


def damaged_indexes(good: Path, folder: Path) -> list[Damage]:
    """Copies of the several-file checkpoint `good`, each with its index or files damaged."""
    index = json.loads((good / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    files = sorted(set(weight_map.values()))
    moved = next(name for name, file in weight_map.items() if file == files[0])
    damages = []

    def copy(name: str) -> Path:
        path = folder / name.replace(" ", "-")
        shutil.copytree(good, path)
        return path

    path = copy("file missing")
    (path / files[1]).unlink()
    damages.append(Damage("index names a missing file", path, ("FileNotFoundError", (
        f"load_full_state_dict: {path / 'model.safetensors.index.json'} names {files[1]}, "
        f"but {path / files[1]} does not exist."))))
    path = copy("tensor elsewhere")
    (path / "model.safetensors.index.json").write_text(
        json.dumps({**index, "weight_map": {**weight_map, moved: files[1]}})
    )
    damages.append(Damage("index names a file without the tensor", path, ("ValueError", (
        f"load_full_state_dict: cannot read {path / 'model.safetensors.index.json'}: it puts "
        f"{moved!r} in {path / files[1]}, which does not hold it."))))
    path = copy("index not JSON")
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')
    damages.append(Damage("index not JSON", path, ("ValueError", (
        f"load_full_state_dict: cannot read {path / 'model.safetensors.index.json'}: it is not "
        "JSON (Expecting value: line 1 column 16 (char 15))."))))
    path = copy("index without map")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    damages.append(Damage("index without weight_map", path, ("ValueError", (
        f"load_full_state_dict: cannot read {path / 'model.safetensors.index.json'}: it has no "
        '"weight_map" object mapping tensor names to file names beside it.'))))
    return damages


def missing_paths(folder: Path) -> list[Damage]:
    absent = folder / "absent.safetensors"
    empty = folder / "empty"
    empty.mkdir()
    return [
        Damage("missing path", absent, ("FileNotFoundError",
            f"load_full_state_dict: {absent} does not exist.")),
        Damage("directory without a checkpoint", empty, ("FileNotFoundError", (
            f"load_full_state_dict: {empty} holds neither model.safetensors nor "
            "model.safetensors.index.json."))),
    ]
