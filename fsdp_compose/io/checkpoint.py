"""Checkpoints on disk: torch.distributed.checkpoint save and load of model, optimizer and step
(each rank writes its shards; loads reshard to any world size), and a safetensors export."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    Metadata,
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
from .checkpoint_files import MetadataCheckingReader, check_files, read_metadata, write_checksums
from .first_rank import from_first_rank
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
    previous checkpoint (or none) at `path`, never a half-written one. Each data file's size
    and CRC-32 go to `.checksums` (the ranks share the reading), for load_checkpoint.
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
    write_checksums(staging)
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

    It loads everything or changes nothing. Before any tensor moves, the checkpoint is
    checked as a whole: `.metadata` readable (with an unpickler that accepts only checkpoint
    metadata classes), its keys and shapes those of the model, every file it names present,
    as long as the byte ranges it gives, and equal to its CRC-32 in `.checksums` (the ranks
    share the reading). Any fault raises one ValueError (FileNotFoundError for a missing
    file) naming the file and the fault, the same on every rank. The tensors are then read
    into copies of this rank's shards of the model and optimizer state, which replace the
    originals only once every rank has read everything, so a fault no check caught leaves
    the model and optimizer as they were. That costs one more copy of this rank's shards
    and optimizer state at the peak (tests/dist/test_checkpoint_damaged.py measures it).
    """
    path = Path(path)
    _check_complete(path)
    reader = MetadataCheckingReader(path)
    metadata = from_first_rank((lambda: read_metadata(reader)) if is_first_rank() else None)
    check_files(path, metadata)
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
    state = _copies(state)  # read into these: the model's own tensors stay untouched
    try:
        dcp_load(state, storage_reader=reader)
    except CheckpointException as failed:  # a BaseException, raised on every rank alike
        raise ValueError(_load_failed(path, failed)) from None
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return int(state["step"]) if has_step else None


def _check_complete(path: Path) -> None:
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


def _copies(state: Any) -> Any:
    """`state` with every tensor cloned (DTensors stay DTensors on their mesh)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {key: _copies(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_copies(value) for value in state]
    return state


def _load_failed(path: Path, failed: CheckpointException) -> str:
    """One message from torch's per-rank failures (the same dict on every rank): each cause's
    first line, with the ranks it was raised on."""
    ranks_by_cause: dict[str, list[str]] = {}
    for rank, (error, _) in sorted(failed.failures.items()):
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        ranks_by_cause.setdefault(f"{type(error).__name__}: {first_line}", []).append(str(rank))
    causes = "; ".join(f"rank {', '.join(ranks)}: {cause}" for cause, ranks in ranks_by_cause.items())
    return (
        f"load_checkpoint: reading {str(path)!r} failed ({causes}); the model and optimizer "
        "are unchanged. The checkpoint is damaged: load another one."
    )


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


