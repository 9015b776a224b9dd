"""Checkpoints on disk: torch.distributed.checkpoint save and load of model, optimizer and step
(each rank writes its shards; loads reshard to any world size), and a safetensors export."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ..comm.collectives import barrier, is_first_rank
from .full_state_dict import INCOMPLETE, save_full_state_dict

REPLACED = ".replaced"  # suffix of the previous checkpoint while the new one takes its name


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
) -> None:
    """Save `model`'s and `optimizer`'s state (sharded: each rank writes its own shards) and
    the training `step` to the directory `path`. Call on every rank.

    The checkpoint is written to `<path>.incomplete` and renamed to `path` only after every
    rank has finished, replacing an older checkpoint there. A crash mid-save leaves the
    previous checkpoint (or none) at `path`, never a half-written one.
    """
    path = Path(path)
    staging = path.with_name(path.name + INCOMPLETE)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if step is not None:
        state["step"] = torch.tensor(step)
    if is_first_rank():
        shutil.rmtree(staging, ignore_errors=True)  # a save that crashed before
    barrier()
    dcp_save(state, storage_writer=FileSystemWriter(staging))
    if is_first_rank():
        replaced = path.with_name(path.name + REPLACED)
        shutil.rmtree(replaced, ignore_errors=True)
        if path.exists():
            path.rename(replaced)  # until the next line, the previous checkpoint is here
        staging.rename(path)
        shutil.rmtree(replaced, ignore_errors=True)
    barrier()


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> int | None:
    """Load a checkpoint written by `save_checkpoint` into `model` (and `optimizer`), at any
    world size; return the saved training step (None if none was saved). Call on every rank.

    Before anything is read, the checkpoint's keys and shapes are compared with the model's;
    a mismatch raises ValueError naming the keys and both shapes, on every rank alike. The
    metadata is read with an unpickler that accepts only checkpoint metadata classes.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        staged = path.name.endswith(INCOMPLETE) or path.with_name(path.name + INCOMPLETE).exists()
        previous = path.with_name(path.name + REPLACED)
        raise FileNotFoundError(
            f"load_checkpoint: {str(path)!r} is not a complete checkpoint (no .metadata)"
            + ("; a save into it was interrupted" if staged else "")
            + (f"; the checkpoint it replaced is at {str(previous)!r}"
               if (previous / ".metadata").is_file() else "")
            + ". Load the last checkpoint that save_checkpoint finished."
        )
    reader = _MetadataCheckingReader(path)
    metadata = reader.read_metadata()
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    _check_model_matches(path, metadata, state["model"])
    if optimizer is not None:
        if not any(key.startswith("optim.") for key in metadata.state_dict_metadata):
            raise ValueError(
                f"load_checkpoint: {str(path)!r} holds no optimizer state; load it without "
                "the optimizer, or save with save_checkpoint(path, model, optimizer)."
            )
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    has_step = "step" in metadata.state_dict_metadata
    if has_step:
        state["step"] = torch.tensor(0)
    dcp_load(state, storage_reader=reader)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return int(state["step"]) if has_step else None


def export_safetensors(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write `model`'s whole weights to one safetensors file at `path` from the first rank:
    `save_full_state_dict` to one file (kept for the callers of this earlier name)."""
    if Path(path).suffix != ".safetensors":
        raise ValueError(f"export_safetensors: {path} must end in .safetensors (or call save_full_state_dict).")
    save_full_state_dict(model, path)


def _check_model_matches(path: Path, metadata: Metadata, model_state: dict[str, Any]) -> None:
    saved = {
        key.removeprefix("model."): item.size
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    expected = {key: value.shape for key, value in model_state.items()}
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    shapes = [
        f"{key!r}: checkpoint {tuple(saved[key])}, model {tuple(shape)}"
        for key, shape in expected.items() if key in saved and saved[key] != shape
    ]
    if missing or unexpected or shapes:
        problems = [
            f"{label} {items}" for label, items in (
                ("missing keys", missing), ("unexpected keys", unexpected),
                ("shape mismatches", shapes),
            ) if items
        ]
        raise ValueError(
            f"load_checkpoint: {str(path)!r} does not match the model: {'; '.join(problems)}. "
            "Was it saved from another model or configuration?"
        )


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


class _MetadataCheckingReader(FileSystemReader):
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
