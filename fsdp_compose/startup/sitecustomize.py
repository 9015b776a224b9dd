"""Run by Python at the start of every process of a program that `python -m fsdp_compose.run`
started: the launcher puts this folder first on PYTHONPATH, which child processes inherit
(multiprocessing's and torch.multiprocessing's spawned children, subprocesses). When the
process first imports torch.distributed.fsdp, its FSDP2 names become fsdp_compose's before any
other module reads them. A process that never imports it never imports torch for this.
The sitecustomize this file hides, if any, still runs."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

_HERE = os.path.dirname(os.path.abspath(__file__))
ENV = "FSDP_COMPOSE_SWITCH"  # "1" in the environment the launcher gives its program (run.py)


class _SwitchOnImport(importlib.abc.MetaPathFinder):
    """Finds torch.distributed.fsdp as Python would; switches once it has run."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch.distributed.fsdp":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def run_then_switch(module: ModuleType) -> None:
                run(module)
                from fsdp_compose.api.torch_switch import replace_torch_fsdp

                replace_torch_fsdp()

            spec.loader.exec_module = run_then_switch  # type: ignore[method-assign]
        return spec


def _start() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    hidden = importlib.machinery.PathFinder.find_spec(__name__, sys.path)
    if hidden is not None and hidden.loader is not None:  # it takes this module's place
        sys.modules[__name__] = module = importlib.util.module_from_spec(hidden)
        hidden.loader.exec_module(module)
    if os.environ.get(ENV) == "1":
        sys.meta_path.insert(0, _SwitchOnImport())


_start()
