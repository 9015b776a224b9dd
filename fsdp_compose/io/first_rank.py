"""What only the first rank can know (it alone touches checkpoint files) and every rank
must act on: its step's value, or its error, raised on every rank so that none hangs."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar, cast

from ..comm.collectives import broadcast_object

T = TypeVar("T")


def from_first_rank(step: Callable[[], T] | None) -> T:
    """`step()`, run on the first rank (the only one to pass it), its value or error on all."""
    value: T | None = None
    error: Exception | None = None
    if step is not None:
        try:
            value = step()
        except Exception as raised:
            error = raised
    value, shared = broadcast_object((value, None if error is None else _portable(error)))
    if shared is None:
        return cast(T, value)
    if shared is error:
        raise error
    raise shared from error  # on the first rank, from its original error


def _portable(error: Exception) -> Exception:
    """`error` if it is a built-in that pickles, else a RuntimeError with its class and message."""
    if type(error).__module__ == "builtins":
        with suppress(Exception):  # one that does not round-trip goes as class and message
            pickle.loads(pickle.dumps(error))
            return error
    return RuntimeError(f"{type(error).__name__}: {error}")


def file_error(what: str, error: OSError) -> OSError:
    """`error` as `what: reason.`, keeping its errno (hence its class: PermissionError...)."""
    if error.errno is None:
        return OSError(f"{what}: {error}.")
    return OSError(error.errno, f"{what}: {error.strerror}.")
