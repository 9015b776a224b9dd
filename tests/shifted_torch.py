"""A check of the checks: with FSDP_COMPOSE_TEST_SHIFT_TORCH=<x> set, torch's `fully_shard`,
as every test process sees it, adds x to each floating-point shard it makes, and again at
the module's first forward (parameters made on the meta device get their values later),
so every value compared with torch's differs. A test that calls it and still passes is reported by
conftest.py: it compares nothing with torch's values, and must either start to or carry
`@pytest.mark.torch_values_unused("why")`.

    FSDP_COMPOSE_TEST_SHIFT_TORCH=1e-3 python -m pytest tests/dist
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Any

SHIFT_ENV = "FSDP_COMPOSE_TEST_SHIFT_TORCH"
MARKS_ENV = "FSDP_COMPOSE_TEST_SHIFT_MARKS"  # a folder: each shifted call leaves a file there


def shift() -> float:
    return float(os.environ.get(SHIFT_ENV) or 0.0)


def install() -> None:
    """Replace `torch.distributed.fsdp.fully_shard` in this process (before the tests import
    it) by one that shifts the shards it made; nothing without SHIFT_ENV."""
    if not shift():
        return
    import torch
    import torch.distributed.fsdp as fsdp
    from torch.distributed.tensor import DTensor

    real = fsdp.fully_shard
    if getattr(real, "shifted", False):
        return

    def shift_shards(module: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in module.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                inexact = local.is_floating_point() or local.is_complex()
                if inexact and local.device.type != "meta":
                    local.add_(shift())

    def shift_at_first_forward(module: torch.nn.Module) -> None:
        def hook(m: torch.nn.Module, _: Any) -> None:
            handle.remove()
            shift_shards(m)

        # Before torch's own pre-forward hook, while the parameters are still shards.
        handle = module.register_forward_pre_hook(hook, prepend=True)

    @functools.wraps(real)
    def shifted(module: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(module, *args, **kwargs)
        for m in module if isinstance(module, (list, tuple)) else [module]:
            shift_shards(m)
            shift_at_first_forward(m)
        pathlib.Path(os.environ[MARKS_ENV], str(os.getpid())).touch()
        return result

    shifted.shifted = True  # type: ignore[attr-defined]
    fsdp.fully_shard = shifted


def take_marks() -> bool:
    """Whether any process called the shifted `fully_shard` since the last call."""
    folder = pathlib.Path(os.environ[MARKS_ENV])
    marks = list(folder.iterdir())
    for mark in marks:
        mark.unlink(missing_ok=True)
    return bool(marks)
