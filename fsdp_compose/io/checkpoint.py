"""Checkpoints on disk: torch.distributed.checkpoint save and load of model, optimizer and step
(each rank writes its shards; loads reshard to any world size)."""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from collections.abc import Mapping
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
from . import resume_state
from .checkpoint_files import CHECKSUMS, MetadataCheckingReader, check_files, checksums
from .first_rank import file_error, from_first_rank
from .resume_state import Stateful
from .safetensors_writer import INCOMPLETE
from .whole_weights import mismatches

REPLACED = ".replaced"  # suffix of the previous checkpoint while the new one takes its name


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None,
                    extra: Mapping[str, Stateful] | None = None, rng: bool = False) -> None:
    """Save `model`'s and `optimizer`'s shards and `step` to the directory `path`, on every rank.
    `extra`: objects whose `state_dict()` to keep too, by name (LR schedulers, data loaders: each
    rank's own); `rng`: each rank's torch, CUDA and Python generators. Written to
    `<path>.incomplete`, then renamed: a crash mid-save leaves the previous checkpoint at `path`."""
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
    resume_state.write(staging, optimizer, extra, rng)
    sums = checksums(staging)
    # The first rank alone renames; every rank raises its error (none waits for a timeout).
    from_first_rank(functools.partial(_publish, staging, path, sums) if is_first_rank() else None)


def _publish(staging: Path, path: Path, sums: str) -> None:
    """Rename `staging` to `path`; between the renames the last one is at `<path>.replaced`."""
    replaced = path.with_name(path.name + REPLACED)
    try:
        (staging / CHECKSUMS).write_text(sums)
        if path.exists():  # else a save was killed between the renames: keep what is there
            if replaced.exists():
                shutil.rmtree(replaced)
            path.rename(replaced)
        staging.rename(path)
    except OSError as error:
        raise file_error(f"save_checkpoint: could not put the checkpoint in place at {str(path)!r}"
                         f" (written to {str(staging)!r}, the previous one kept)", error) from error
    shutil.rmtree(replaced, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *,
                    extra: Mapping[str, Stateful] | None = None, rng: bool = False) -> int | None:
    """Load what `save_checkpoint` (or DCP's `{"app": AppState(model, optimizer)}` recipe) wrote,
    at any world size (`extra`, `rng`: each rank its own, else the first rank's); return the step
    or None. Call on every rank. All or nothing: metadata, keys, shapes, sizes and CRC-32s are
    checked first (the same error on every rank); tensors are read into copies (one more copy)."""
    path = Path(path)
    previous = path.with_name(path.name + REPLACED)
    # A save killed between its renames: the checkpoint it replaced is the last one.
    if not path.exists() and (previous / ".metadata").is_file():
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
    state: dict[str, Any] = {"model": dcp_state.get_model_state_dict(model)}
    prefix, saved = _matched(path, metadata.state_dict_metadata, state["model"])
    put_in_place = resume_state.read(path, optimizer, extra, rng)
    fresh = optimizer is not None and not optimizer.state
    if optimizer is not None:
        if not any(key.startswith("optim.") for key in saved):
            raise ValueError(f"load_checkpoint: {str(path)!r} holds no optimizer state; load "
                             "without it, or save with save_checkpoint(path, model, optimizer).")
        state["optim"] = dcp_state.get_optimizer_state_dict(model, optimizer)
    if "step" in saved:
        state["step"] = torch.tensor(0)
    state = _copies(state)  # read into these: the model's own tensors stay untouched
    # Under the checkpoint's key prefix: "app." -> {"app": state}.
    nested = functools.reduce(lambda d, k: {k: d}, reversed(prefix.split(".")[:-1]), state)
    try:
        dcp_load(nested, storage_reader=reader)
    except CheckpointException as failed:  # a BaseException, raised on every rank alike
        if fresh:  # DCP stepped it once to create its state: fresh again
            optimizer.state.clear()  # type: ignore[union-attr]
        raise ValueError(_load_failed(path, failed)) from None
    dcp_state.set_model_state_dict(model, state["model"])
    if optimizer is not None:
        dcp_state.set_optimizer_state_dict(model, optimizer, state["optim"])
    put_in_place()
    return int(state["step"]) if "step" in state else None


def _matched(path: Path, saved: Mapping[str, Any], model_state: Mapping[str, Any]
             ) -> tuple[str, dict[str, Any]]:
    """The keys' prefix ("app." from DCP's recipe) and the items without it, if they fit."""
    probe = next(iter(model_state), None)
    found = {k[: -len(f"model.{probe}")] for k in saved if k.endswith(f".model.{probe}")}
    if probe is None or any(k.startswith("model.") for k in saved):
        prefix = ""
    elif len(found) == 1:
        prefix = found.pop()
    else:
        beginnings = sorted({".".join(k.split(".")[:2]) + "." for k in saved})
        raise ValueError(f"load_checkpoint: {str(path)!r} holds none of the model's keys: its keys "
                         f"begin with {beginnings[:8]}, where load_checkpoint looks for "
                         f"'model.{probe}' and the model's other keys under 'model.' (and "
                         "'optim.', 'step'). Saved under other names? Load it with dcp.load "
                         "into the structure it was saved from.")
    items = {k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)}
    shapes = {k.removeprefix("model."): tuple(item.size) for k, item in items.items()
              if k.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    if problems := mismatches(shapes, model_state):
        raise ValueError(f"load_checkpoint: {str(path)!r} does not match the model: {problems}. "
                         "Was it saved from another model or configuration?")
    return prefix, items


def _copies(state: Any) -> Any:
    """`state` with every tensor cloned (DTensors stay DTensors on their mesh)."""
    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone(), state)


def _load_failed(path: Path, failed: CheckpointException) -> str:
    """torch's per-rank failures (the same on every rank): each cause's first line, its ranks."""
    ranks_by_cause: dict[str, list[str]] = {}
    for rank, (error, _) in sorted(failed.failures.items()):
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        ranks_by_cause.setdefault(f"{type(error).__name__}: {first_line}", []).append(str(rank))
    causes = "; ".join(f"rank {', '.join(r)}: {cause}" for cause, r in ranks_by_cause.items())
    return (f"load_checkpoint: reading {str(path)!r} failed ({causes}); the model and optimizer "
            "are unchanged. The checkpoint is damaged: load another one.")

