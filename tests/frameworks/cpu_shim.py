"""Test-only: run a program with accelerate's FSDP allowed on CPU (gloo), alike for torch's
fully_shard and fsdp_compose's, and with the check of the checks' shift on torch's.

    torchrun --nproc_per_node=2 -m tests.frameworks.cpu_shim SCRIPT [ARGS...]
    torchrun --nproc_per_node=2 -m fsdp_compose.run -m tests.frameworks.cpu_shim SCRIPT [ARGS...]

accelerate takes the FSDP path only for accelerator process groups (MULTI_GPU, MULTI_XPU, ...);
with `use_cpu=True` it makes a MULTI_CPU (gloo) state and trains without FSDP. The shim makes
a MULTI_CPU state that was given an FSDP plugin an FSDP state, with the lines accelerate runs
for the accelerator types (AcceleratorState.__init__); nothing else of accelerate changes.

It also installs tests/shifted_torch.py's shift (FSDP_COMPOSE_TEST_SHIFT_TORCH, the check of
the checks) when torch's own fully_shard is the one in place, before the program imports
it, as the in-process tests get it; under fsdp_compose.run it is not torch's, and nothing is
shifted. Without accelerate installed only the shift is done (the Lightning test).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys


def install() -> None:
    import torch.distributed.fsdp as torch_fsdp

    from tests import shifted_torch

    if torch_fsdp.fully_shard.__module__.startswith("torch."):
        shifted_torch.install()
    if importlib.util.find_spec("accelerate") is None:
        return

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__
    if getattr(original_init, "cpu_shim", False):
        return

    def init(self, mixed_precision=None, cpu=False, dynamo_plugin=None, deepspeed_plugin=None,
             fsdp_plugin=None, *args, **kwargs):
        was_initialized = AcceleratorState._shared_state != {}
        original_init(self, mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin,
                      *args, **kwargs)
        if (
            not was_initialized
            and fsdp_plugin is not None
            and self.distributed_type == DistributedType.MULTI_CPU
        ):
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type

    init.cpu_shim = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init


def main() -> None:
    if not sys.argv[1:]:
        raise SystemExit("usage: python -m tests.frameworks.cpu_shim SCRIPT [ARGS...]")
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
