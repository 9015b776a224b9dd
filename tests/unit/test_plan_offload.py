"""plan() with CPU offload the way it runs on a GPU: the mesh on an accelerator, the shards,
their gradients and AdamW's state in CPU memory.

A CPU-only machine has no accelerator, so the meta device stands in for one: it gets the
device module plan() and fully_shard ask for (torch.meta), and a copy off it gives zeros
(meta tensors have shapes and sizes but no data; the planner needs only those). What runs
is the GPU's offload path: a mesh whose device is not the shards' device, gradients
reduced there and copied back to the CPU shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import Setup, plan
from tests.models import Transformer, lm_loss, token_batch

OFFLOADED = [
    Setup(cpu_offload=True),
    Setup(blocks_per_unit=2, reshard_after_forward=False, cpu_offload=True),
]


class _CopiesOffMetaReadZeros(TorchDispatchMode):
    """A copy from the meta device to the CPU gives zeros instead of raising "Cannot copy
    out of meta tensor": the device-to-host copy of a reduced gradient under offload."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].is_meta:
            to = kwargs.get("device") or args[0].device
            if to.type != "meta":
                dtype = kwargs.get("dtype") or args[0].dtype
                return torch.zeros(args[0].shape, dtype=dtype, device=to)
        if func is torch.ops.aten.copy_.default and args[1].is_meta and not args[0].is_meta:
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_accelerator() -> Iterator[None]:
    """The meta device as an accelerator, inside the block."""
    torch.meta = SimpleNamespace(  # type: ignore[attr-defined]
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        set_device=lambda device: None,
    )
    try:
        with _CopiesOffMetaReadZeros():
            yield
    finally:
        del torch.meta  # type: ignore[attr-defined]
        torch.get_device_module.cache_clear()  # it cached torch.meta


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(dim=32, heads=4, depth=4)


def simulate(device: str) -> dict[Setup, tuple[int, int]]:
    plans = plan(build, world_size=2, sample_input=token_batch(0, 8), loss_fn=lm_loss,
                 setups=OFFLOADED, device=device)
    return {p.setup: (p.peak_bytes, p.bytes_per_step) for p in plans}


def test_offload_on_an_accelerator_keeps_shards_grads_and_optimizer_state_off_it():
    on_cpu = simulate("cpu")  # where offload moves nothing
    with meta_accelerator():
        # Before the fix: "attempting to assign a gradient with device type 'cpu' to a
        # tensor with device type 'meta'" ('cuda' on a GPU): the sharded parameter had
        # been copied to the mesh's device while its shard stayed in CPU memory.
        on_accelerator = simulate("meta")
    shard_bytes = sum(p.numel() * p.element_size() for p in build().parameters()) // 2
    for setup in OFFLOADED:
        (device_peak, device_bytes), (cpu_peak, cpu_bytes) = on_accelerator[setup], on_cpu[setup]
        assert device_bytes == cpu_bytes, setup  # offload changes where, not what, is sent
        # The CPU's peak holds AdamW's two moments of this rank's shards; with offload they
        # stay in CPU memory, so the accelerator's peak is lower by at least that.
        assert device_peak <= cpu_peak - 2 * shard_bytes, (
            setup, device_peak, cpu_peak, shard_bytes)
