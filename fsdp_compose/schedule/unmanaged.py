"""Parameters no unit manages: with only the blocks annotated, a model's own parameters
(embeddings, a head, a final norm) train on each rank apart, unsynchronised, and drift.
Said once, with their names, when a model holding units first runs forward."""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch
from torch import nn

from ..comm.process_wide import Piece
from .iteration import state_of


class UnmanagedParametersWarning(UserWarning):
    """A model with fully_shard units runs forward with trainable parameters outside every unit.
    To keep such parameters apart on purpose, filter this category of warnings."""


# Marks the sharded parameters fully_shard made and the ones it was told to ignore.
_ACCOUNTED_MARK = "_fsdp_compose_accounted"
_looked_at: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _install() -> Callable[[], None]:
    # Run eagerly under torch.compile: dynamo cannot trace its weak set.
    return nn.modules.module.register_module_forward_pre_hook(torch.compiler.disable(_look)).remove


_WATCH = Piece("unmanaged-parameter watch (a module forward pre-hook)", _install)


def watch(unit: object, accounted: Iterable[torch.Tensor]) -> None:
    """fully_shard made `unit`: look at the modules called until a root's first forward (a
    global hook, removed then, so that later steps pay nothing, or once no such unit lives)."""
    for tensor in accounted:
        setattr(tensor, _ACCOUNTED_MARK, True)
    _WATCH.hold(unit)


def stop_watching() -> None:
    """A root ran its first forward: every module enclosing it was called already."""
    _WATCH.remove()


# Frames of these packages sit between the user's call and the hook that warns.
_INTERNAL = ("torch", __name__.split(".")[0])


def _look(module: nn.Module, args: Any) -> None:
    """Before the first root: warn of a module holding units, not one, with trainable parameters
    in none."""
    if module in _looked_at or state_of(module) is not None:
        return
    inside = list(module.modules())
    _looked_at.update(inside)  # its submodules are covered by this one look
    if all(state_of(m) is None for m in inside):
        return
    names = [fqn for fqn, p in module.named_parameters()
             if p.requires_grad and not hasattr(p, _ACCOUNTED_MARK)]
    if not names:
        return
    message = (
        f"fsdp_compose: {type(module).__name__} holds fully_shard units but is not one, and its "
        f"parameters {names} are in no unit: each rank trains them apart, unsynchronised, and "
        "they drift. Annotate it too, after its blocks (fully_shard(model); its ignored_params "
        "stay whole but are then yours to synchronise); to keep them apart on purpose, filter "
        "fsdp_compose.UnmanagedParametersWarning."
    )
    # Warn as from the user's line that ran the forward: this hook runs inside torch's
    # Module.__call__, so a fixed stacklevel would name torch's module.py, which a filter on
    # the user's module misses and a filter on torch hides. warn_explicit, not a counted
    # stacklevel: warnings.warn's own frame skipping (importlib's) would shift the count.
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__")).split(".")[0] in _INTERNAL:
        frame = frame.f_back  # to the innermost frame outside torch and fsdp_compose
    if frame is None:  # no user code on this stack (a thread started inside torch)
        warnings.warn(message, UnmanagedParametersWarning, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message, UnmanagedParametersWarning, frame.f_code.co_filename, frame.f_lineno,
        module=module_globals.get("__name__", "<string>"),  # as warnings.warn names it
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )
