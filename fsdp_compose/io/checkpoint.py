"""Checkpoints on disk: torch.distributed.checkpoint save and load of model, optimizer and step
(each rank writes its shards; loads reshard to any world size), and a safetensors export."""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.utils._pytree import tree_map_only

from ..comm.collectives import barrier, is_first_rank
from .checkpoint_files import CHECKSUMS, MetadataCheckingReader, check_files, checksums
from .first_rank import file_error, from_first_rank
from .full_state_dict import mismatches, save_full_state_dict
from .safetensors_writer import INCOMPLETE

REPLACED = ".replaced"  # suffix of the previous checkpoint while the new one takes its name


def save_checkpoint(
    path: str | os.PathLike[str], model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None,
) -> None:
    """Save `model`'s and `optimizer`'s state (each rank writes its shards) and the training
    `step` to the directory `path`; call on every rank. It is written to `<path>.incomplete`
    and renamed to `path` once every rank finished, so a crash mid-save leaves the previous
    checkpoint (or none) at `path`, never a half-written one."""
    path = Path(path)
    staging = path.with_name(path.name + INCOMPLETE)
    state: dict[str, Any] = {"model": dcp_state.get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = dcp_state.get_optimizer_state_dict(model, optimizer)
    if step is not None:
        state["step"] = torch.tensor(step)
    if is_first_rank():
        shutil.rmtree(staging, ignore_errors=True)  # a save that crashed before
    barrier()
    dcp_save(state, storage_writer=FileSystemWriter(staging))
    sums = checksums(staging)
    # The first rank alone renames; every rank raises its error (none waits for a timeout).
    from_first_rank(functools.partial(_publish, staging, path, sums) if is_first_rank() else None)


def _publish(staging: Path, path: Path, sums: str) -> None:
    """Give the finished checkpoint in `staging` the name `path`. At every moment a complete
    checkpoint is at `path` or, between the two renames, at `<path>.replaced`, where
    load_checkpoint looks next."""
    replaced = path.with_name(path.name + REPLACED)
    try:
        (staging / CHECKSUMS).write_text(sums)
        if path.exists():  # else a save was killed between the renames: keep what is there
            if replaced.exists():
                shutil.rmtree(replaced)
            path.rename(replaced)
        staging.rename(path)
    except OSError as error:
        raise file_error(f"save_checkpoint: could not put the checkpoint in place at {str(path)!r} "
                         f"(written to {str(staging)!r}, the previous one kept)", error) from error
    shutil.rmtree(replaced, ignore_errors=True)


def load_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int | None:
    """Load a checkpoint written by `save_checkpoint` into `model` (and `optimizer`), at any
    world size; return the saved step (None if none was saved). Call on every rank.

    It loads everything or changes nothing. Before any tensor moves, the metadata, the
    model's keys and shapes and every file's size and CRC-32 are checked; a fault raises one
    ValueError (FileNotFoundError for a missing file) naming the file, the same on every
    rank. Tensors are read into copies of this rank's state (one more copy at the peak),
    which replace the originals only once every rank read everything."""
    path = Path(path)
    previous = path.with_name(path.name + REPLACED)
    if not (path / ".metadata").is_file() and (previous / ".metadata").is_file() \
            and not path.exists():  # a save killed between its renames: the last checkpoint
        warnings.warn(f"load_checkpoint: {str(path)!r} is missing, a save into it having stopped; "
                      f"loading the checkpoint it was replacing, {str(previous)!r}.", stacklevel=2)
        path = previous
    if not (path / ".metadata").is_file():
        staged = path.name.endswith(INCOMPLETE) or path.with_name(path.name + INCOMPLETE).exists()
        raise FileNotFoundError(
            f"load_checkpoint: {str(path)!r} is not a complete checkpoint (no .metadata)"
            + ("; a save into it was interrupted" if staged else "")
            + (f"; the checkpoint it replaced is at {str(previous)!r}"
               if (previous / ".metadata").is_file() else "")
            + ". Load the last checkpoint that save_checkpoint finished."
        )
    reader = MetadataCheckingReader(path)
    metadata = from_first_rank(reader.read_metadata if is_first_rank() else None)
    check_files(path, metadata)
    saved = metadata.state_dict_metadata
    state: dict[str, Any] = {"model": dcp_state.get_model_state_dict(model)}
    shapes = {k.removeprefix("model."): tuple(item.size) for k, item in saved.items()
              if k.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    if problems := mismatches(shapes, {k: tuple(v.shape) for k, v in state["model"].items()}):
        raise ValueError(f"load_checkpoint: {str(path)!r} does not match the model: {problems}. "
                         "Was it saved from another model or configuration?")
    fresh = optimizer is not None and not optimizer.state
    if optimizer is not None:
        if not any(key.startswith("optim.") for key in saved):
            raise ValueError(f"load_checkpoint: {str(path)!r} holds no optimizer state; load it without "
                             "the optimizer, or save with save_checkpoint(path, model, optimizer).")
        state["optim"] = dcp_state.get_optimizer_state_dict(model, optimizer)
    if "step" in saved:
        state["step"] = torch.tensor(0)
    state = _copies(state)  # read into these: the model's own tensors stay untouched
    try:
        dcp_load(state, storage_reader=reader)
    except CheckpointException as failed:  # a BaseException, raised on every rank alike
        if fresh:  # DCP stepped it once to create its state: fresh again
            optimizer.state.clear()  # type: ignore[union-attr]
        raise ValueError(_load_failed(path, failed)) from None
    dcp_state.set_model_state_dict(model, state["model"])
    if optimizer is not None:
        dcp_state.set_optimizer_state_dict(model, optimizer, state["optim"])
    return int(state["step"]) if "step" in state else None


def _copies(state: Any) -> Any:
    """`state` with every tensor cloned (DTensors stay DTensors on their mesh)."""
    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone(), state)


def _load_failed(path: Path, failed: CheckpointException) -> str:
    """torch's per-rank failures (the same on every rank) in one message: each cause's first
    line, with its ranks."""
    ranks_by_cause: dict[str, list[str]] = {}
    for rank, (error, _) in sorted(failed.failures.items()):
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        ranks_by_cause.setdefault(f"{type(error).__name__}: {first_line}", []).append(str(rank))
    causes = "; ".join(f"rank {', '.join(ranks)}: {cause}" for cause, ranks in ranks_by_cause.items())
    return (f"load_checkpoint: reading {str(path)!r} failed ({causes}); the model and optimizer "
            "are unchanged. The checkpoint is damaged: load another one.")


def export_safetensors(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """`save_full_state_dict` to one file `path` (kept for the callers of this earlier name)."""
    if Path(path).suffix != ".safetensors":
        raise ValueError(f"export_safetensors: {path} must end in .safetensors "
                         "(or call save_full_state_dict).")
    save_full_state_dict(model, path)
