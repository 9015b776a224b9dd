"""What a resume needs beside the tensors DCP keeps, in one small file per rank: param groups
whole (DCP loads `initial_lr` only into a fresh optimizer), `extra` states, RNG states."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..comm.collectives import every_rank

FILE = "resume.rank{}.pt"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


def _raise_on_every_rank(problem: str | None, error: type[Exception]) -> None:
    """Every rank raises the first problem any rank found (a collective: all call it)."""
    if found := [p for p in every_rank(problem) if p is not None]:
        raise error(found[0])


def write(folder: Path, optimizer: torch.optim.Optimizer | None,
          extra: Mapping[str, Stateful] | None, rng: bool) -> None:
    """This rank's file in `folder` (none if there is nothing to keep); call on every rank."""
    kept: dict[str, Any] = {}
    if optimizer is not None:
        kept["param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                for g in optimizer.param_groups]
    if extra:
        kept["extra"] = {name: obj.state_dict() for name, obj in extra.items()}
    if rng:
        kept["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                       "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    problem, rank = None, dist.get_rank() if dist.is_initialized() else 0
    if kept:
        try:
            torch.save(kept, folder / FILE.format(rank))
        except Exception as error:  # an object's state that does not save, a full disk
            problem = (f"save_checkpoint: rank {rank} could not write "
                       f"{str(folder / FILE.format(rank))!r}: {type(error).__name__}: {error}")
    _raise_on_every_rank(problem, OSError)


def read(folder: Path, optimizer: torch.optim.Optimizer | None,
         extra: Mapping[str, Stateful] | None, rng: bool) -> Callable[[], None]:
    """Check this rank's file (else rank 0's), raising on every rank; return what loads it."""
    own = folder / FILE.format(dist.get_rank() if dist.is_initialized() else 0)
    file = own if own.is_file() else folder / FILE.format(0)
    kept: dict[str, Any] = {}
    problem = None
    if file.is_file():
        try:
            kept = torch.load(file, weights_only=True)  # no code runs
        except Exception as error:
            problem = (f"load_checkpoint: {str(file)!r} is damaged ({type(error).__name__}: "
                       f"{error}); nothing was loaded. Load another checkpoint.")
    if problem is None:
        problem = _missing(file, kept, optimizer, extra or {}, rng)
    _raise_on_every_rank(problem, ValueError)

    def put_in_place() -> None:
        if optimizer is not None and "param_groups" in kept:
            for group, saved in zip(optimizer.param_groups, kept["param_groups"]):
                group.update(saved)
        for name, obj in (extra or {}).items():
            obj.load_state_dict(kept["extra"][name])
        if rng:
            torch.set_rng_state(kept["rng"]["torch"])
            random.setstate(kept["rng"]["python"])
            if kept["rng"]["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(kept["rng"]["cuda"])
    return put_in_place


def _missing(file: Path, kept: dict[str, Any], optimizer: torch.optim.Optimizer | None,
             extra: Mapping[str, Stateful], rng: bool) -> str | None:
    """What the caller asks for that the checkpoint does not hold, in words."""
    saved = sorted(kept.get("extra", {}))
    if missing := sorted(set(extra) - set(saved)):
        return (f"load_checkpoint: {str(file.parent)!r} keeps no state of {missing} (it keeps "
                f"{saved or 'none'}); save with save_checkpoint(..., extra={{name: object}}).")
    if rng and "rng" not in kept:
        return (f"load_checkpoint: {str(file.parent)!r} keeps no random number generator states; "
                "save with save_checkpoint(..., rng=True), or load with rng=False.")
    groups = kept.get("param_groups")
    if optimizer is not None and groups is not None and len(groups) != len(optimizer.param_groups):
        return (f"load_checkpoint: {str(file.parent)!r} was saved from an optimizer of "
                f"{len(groups)} param groups; this one has {len(optimizer.param_groups)}.")
    return None
