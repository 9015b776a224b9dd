"""Setup, one way to annotate a model that plan() tries, and Plan, what it costs per rank:
its peak, bytes communicated per step and verdict under a budget; sizes in words and back."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..api.activation_checkpointing import checkpoint_blocks
from ..api.fully_shard import fully_shard
from ..param.policies import CPUOffloadPolicy, OffloadPolicy

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way to annotate a model whose blocks are `model.<blocks>` (a ModuleList)."""

    blocks_per_unit: int = 1
    reshard_after_forward: bool | int = True
    checkpoint_every: int | None = None  # checkpoint_blocks(every=...), or no recomputation
    cpu_offload: bool = False  # offload_policy=CPUOffloadPolicy()

    def apply(self, model: nn.Module, blocks: str, mesh: DeviceMesh | None = None) -> None:
        """Annotate `model` (not yet annotated) this way over `mesh` (default: fully_shard's)."""
        layers = block_list(model, blocks)
        if self.checkpoint_every is not None:
            checkpoint_blocks(model, type(layers[0]), every=self.checkpoint_every)
        pin = torch.accelerator.is_available()
        offload = CPUOffloadPolicy(pin_memory=pin) if self.cpu_offload else OffloadPolicy()
        k = self.blocks_per_unit
        for i in range(0, len(layers), k):
            fully_shard(list(layers[i:i + k]) if k > 1 else layers[i], mesh=mesh,
                        reshard_after_forward=self.reshard_after_forward, offload_policy=offload)
        fully_shard(model, mesh=mesh, offload_policy=offload)

    def code(self, blocks: str, block_class: str) -> str:
        """The calls that realise it, for a model named `model`."""
        lines = []
        if self.checkpoint_every is not None:
            lines.append(f"checkpoint_blocks(model, {block_class}, every={self.checkpoint_every})")
        offload = ", offload_policy=CPUOffloadPolicy()" if self.cpu_offload else ""
        option = offload if self.reshard_after_forward is True else (
            f", reshard_after_forward={self.reshard_after_forward}{offload}")
        k = self.blocks_per_unit
        lines.append(f"for block in model.{blocks}:\n    fully_shard(block{option})" if k == 1 else
                     f"for i in range(0, len(model.{blocks}), {k}):\n"
                     f"    fully_shard(list(model.{blocks}[i:i + {k}]){option})")
        lines.append(f"fully_shard(model{offload})")
        return "\n".join(lines)

    def describe(self) -> str:
        """In words: "1 block(s)/unit, reshard_after_forward=True, no activation checkpointing"."""
        every = self.checkpoint_every
        checkpointing = "no activation checkpointing" if every is None else (
            f"activation checkpointing of {'every block' if every == 1 else f'1 block in {every}'}")
        return (f"{self.blocks_per_unit} block(s)/unit, reshard_after_forward="
                f"{self.reshard_after_forward}, {checkpointing}"
                + (", CPU offload" if self.cpu_offload else ""))


@dataclasses.dataclass
class Plan:
    """A setup's cost per rank and step: simulated, or (`simulated` False) its peak's bound."""

    setup: Setup
    peak_bytes: int  # tracked tensor memory per rank at its peak; not simulated: the bound
    bytes_per_step: int | None  # all-gather and reduce-scatter buffers (None: not simulated)
    fits: bool | None  # within the memory budget (None: no budget given)
    code: str  # the calls that realise the setup
    memory_budget: int | None = None  # bytes per rank
    simulated: bool = True

    def __str__(self) -> str:
        parts = [self.setup.describe(), f"peak {self.peak_words()}"]
        if self.bytes_per_step is not None:
            parts.append(f"{size(self.bytes_per_step)}/step communicated")
        if self.fits is False and self.memory_budget is not None:
            return " | ".join([*parts, f"{self.verdict()} the {size(self.memory_budget)} budget"])
        return " | ".join(parts + [self.verdict()] if self.fits is not None else parts)

    def peak_words(self) -> str:
        """The peak in words: "at least ..." where only its lower bound is known."""
        return size(self.peak_bytes) if self.simulated else f"at least {size(self.peak_bytes)}"

    def verdict(self) -> str:
        """"fits", "does not fit[: <bytes> over]", or "" without a budget."""
        if self.fits is not False or self.memory_budget is None:
            return {None: "", True: "fits", False: "does not fit"}[self.fits]
        over = size(self.peak_bytes - self.memory_budget)
        return f"does not fit: {over if self.simulated else 'at least ' + over} over"


def block_list(model: nn.Module, blocks: str) -> nn.ModuleList:
    """The ModuleList `model.<blocks>`, which a Setup groups into units."""
    layers = model.get_submodule(blocks)
    assert isinstance(layers, nn.ModuleList), f"model.{blocks} is not a ModuleList"
    return layers


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit (up to GiB) that keeps a number of at least 1."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


_POWERS = {"k": (10, 3), "m": (20, 6), "g": (30, 9), "t": (40, 12)}  # of 2 with "i", else of 10
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?)(b?)|(b?))\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """"64MiB" (64 x 2^20), "64MB" (64 x 10^6), "2048" or "2048B" as bytes, in any case;
    ValueError for anything else, or a unit without its B ("64M", "64Mi"): ambiguous."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 64MiB = 64 x 2^20 bytes, 64MB = 64 x "
                         "10^6 bytes, 2048 = 2048 bytes)")
    number, unit, binary, b = match[1], (match[2] or "").lower(), match[3], match[4]
    if not unit:
        return int(Decimal(number))
    two, ten = _POWERS[unit]
    if not b:
        decimal = unit if unit == "k" else unit.upper()
        raise ValueError(f"an ambiguous size: {text!r}; say {number}{unit.upper()}iB (2^{two} "
                         f"bytes) or {number}{decimal}B (10^{ten} bytes)")
    return int(Decimal(number) * (2**two if binary else 10**ten))
