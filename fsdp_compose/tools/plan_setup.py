"""Setup, one way to annotate a model that plan() tries, and Plan, what it costs per rank:
its peak, its bytes communicated per step and its verdict under a budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..api.activation_checkpointing import checkpoint_blocks
from ..api.fully_shard import fully_shard
from ..param.policies import CPUOffloadPolicy, OffloadPolicy
from .plan_bytes import size

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
    """A setup and what it costs per rank and step: simulated, or (`simulated` False) ruled
    out under the budget by a lower bound of its peak."""

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
        verdict = self.verdict()
        if verdict and self.fits is False and self.memory_budget is not None:
            verdict += f" the {size(self.memory_budget)} budget"
        return " | ".join(parts + ([verdict] if verdict else []))

    def peak_words(self) -> str:
        """The peak in words: "at least ..." where only its lower bound is known."""
        return size(self.peak_bytes) if self.simulated else f"at least {size(self.peak_bytes)}"

    def verdict(self) -> str:
        """"fits", "does not fit[: <bytes> over]", or "" without a budget."""
        if self.fits is None:
            return ""
        if self.fits:
            return "fits"
        if self.memory_budget is None:
            return "does not fit"
        over = size(self.peak_bytes - self.memory_budget)
        return f"does not fit: {over if self.simulated else 'at least ' + over} over"


def block_list(model: nn.Module, blocks: str) -> nn.ModuleList:
    """The ModuleList `model.<blocks>`, which a Setup groups into units."""
    layers = model.get_submodule(blocks)
    assert isinstance(layers, nn.ModuleList), f"model.{blocks} is not a ModuleList"
    return layers
