"""Whole checkpoints' files in one process, no process group: the header checks accept what
the safetensors package writes and refuse what it refuses, and a save that fails leaves
no staging file and the previous checkpoint as it was."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import fsdp_compose.io.safetensors_writer as safetensors_writer
from fsdp_compose import save_full_state_dict
from fsdp_compose.io.safetensors_header import read_headers
from tests.models import Transformer
from tests.safetensors_damage import damaged_files


def test_headers_of_what_safetensors_writes_are_read(tmp_path):
    tensors = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 7),
        "also empty": torch.zeros(3, 0, dtype=torch.int8),
        "odd": torch.arange(7, dtype=torch.int16).reshape(7, 1),
        "half": torch.randn(5, 3).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.randn(9).to(torch.float8_e4m3fn),
    }
    written = tmp_path / "written.safetensors"
    save_file(tensors, written, metadata={"format": "pt"})
    data = written.read_bytes()
    saved = read_headers(written)
    assert saved.keys() == tensors.keys()
    for name, tensor in tensors.items():
        entry = saved[name]
        assert (entry.shape, entry.file) == (list(tensor.shape), str(written))
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data[entry.start : entry.end] == raw, name


def test_damaged_files_refused_as_safetensors_refuses_them(tmp_path):
    torch.manual_seed(0)
    save_full_state_dict(Transformer(tie_weights=True), tmp_path / "good.safetensors")
    for damage in damaged_files(tmp_path / "good.safetensors", tmp_path):
        with pytest.raises(ValueError) as raised:
            read_headers(damage.path)
        assert (type(raised.value).__name__, str(raised.value)) == damage.error, damage.name
        with pytest.raises(SafetensorError):  # the format's own reader agrees
            load_file(damage.path)


def test_full_disk_leaves_no_staging_file_and_the_previous_checkpoint(tmp_path, monkeypatch):
    torch.manual_seed(0)
    save_full_state_dict(Transformer(tie_weights=True), tmp_path)
    previous = (tmp_path / "model.safetensors").read_bytes()
    write = safetensors_writer._Writer.write
    writes = []

    def filling(self: object, tensor: torch.Tensor) -> None:
        writes.append(tensor)
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(self, tensor)

    monkeypatch.setattr(safetensors_writer._Writer, "write", filling)
    torch.manual_seed(1)
    with pytest.raises(OSError) as raised:
        save_full_state_dict(Transformer(tie_weights=True), tmp_path)
    assert str(raised.value) == (
        f"[Errno 28] save_full_state_dict: cannot write {tmp_path / 'model.safetensors'}: "
        "No space left on device."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == previous
