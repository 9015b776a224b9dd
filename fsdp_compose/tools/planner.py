"""plan(): try candidate setups of a model in one process before running it, and rank them.

Each candidate (blocks per unit, reshard_after_forward, activation checkpointing every n
blocks) trains two steps as rank 0 of a `world_size`-rank job on the fake process group,
which fills the collectives' outputs without other processes: the shapes, sizes and
allocations are the real job's. torch's MemTracker gives the peak of tracked tensor
memory per rank (parameters, gradients, optimizer state, activations, buffers), a dispatch
counter the bytes of every collective. A candidate fits when its peak is within the
budget; those that do not are listed by how far they miss it. It runs on the accelerator
when there is one (the memory it predicts is that device's), else on the CPU. CPU offload
moves shards, gradients and optimizer state off the accelerator: a candidate there; on the
CPU it would move nothing, so not a candidate.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from ..api.activation_checkpointing import checkpoint_blocks
from ..api.fully_shard import fully_shard
from ..param.policies import CPUOffloadPolicy

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way to annotate a model whose blocks are `model.<blocks>` (a ModuleList)."""

    blocks_per_unit: int = 1
    reshard_after_forward: bool | int = True
    checkpoint_every: int | None = None  # checkpoint_blocks(every=...), or no recomputation
    cpu_offload: bool = False  # offload_policy=CPUOffloadPolicy()

    def apply(self, model: nn.Module, blocks: str, mesh: DeviceMesh | None = None) -> None:
        """Annotate `model` (not yet annotated) this way, over `mesh` (default: fully_shard's);
        `blocks` names its ModuleList."""
        layers = _layers(model, blocks)
        if self.checkpoint_every is not None:
            checkpoint_blocks(model, type(layers[0]), every=self.checkpoint_every)
        options: dict[str, Any] = {"mesh": mesh}
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
        k = self.blocks_per_unit
        for i in range(0, len(layers), k):
            group = list(layers[i:i + k])
            unit = group if k > 1 else group[0]
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **options)
        fully_shard(model, **options)

    def code(self, blocks: str, block_class: str) -> str:
        """The calls that realise it, for a model named `model`."""
        lines = []
        if self.checkpoint_every is not None:
            lines.append(f"checkpoint_blocks(model, {block_class}, every={self.checkpoint_every})")
        option = "" if self.reshard_after_forward is True else (
            f", reshard_after_forward={self.reshard_after_forward}"
        )
        offload = ", offload_policy=CPUOffloadPolicy()" if self.cpu_offload else ""
        option += offload
        k = self.blocks_per_unit
        if k == 1:
            lines.append(f"for block in model.{blocks}:\n    fully_shard(block{option})")
        else:
            lines.append(f"for i in range(0, len(model.{blocks}), {k}):\n"
                         f"    fully_shard(list(model.{blocks}[i:i + {k}]){option})")
        lines.append(f"fully_shard(model{offload})")
        return "\n".join(lines)


@dataclasses.dataclass
class Plan:
    """A simulated setup: what it costs per rank and step."""

    setup: Setup
    peak_bytes: int  # tracked tensor memory per rank, at its peak
    bytes_per_step: int  # every all-gather's and reduce-scatter's buffer, one step
    fits: bool | None  # within the memory budget (None: no budget given)
    code: str
    memory_budget: int | None = None  # bytes per rank, as plan() was given it

    def __str__(self) -> str:
        s = self.setup
        offload = ", CPU offload" if s.cpu_offload else ""
        return (f"{s.blocks_per_unit} block(s)/unit, reshard_after_forward={s.reshard_after_forward}, "
                f"{_checkpointing(s.checkpoint_every)}{offload}: peak {size(self.peak_bytes)}, "
                f"{size(self.bytes_per_step)}/step communicated{self._verdict()}")

    def _verdict(self) -> str:
        if self.fits is None:
            return ""
        if self.fits:
            return " fits"
        if self.memory_budget is None:
            return " does not fit"
        over = self.peak_bytes - self.memory_budget
        return f"; does not fit: {size(over)} over the {size(self.memory_budget)} budget"


def _checkpointing(every: int | None) -> str:
    """Setup.checkpoint_every in words (checkpoint_blocks(every=n) recomputes every n-th block)."""
    if every is None:
        return "no activation checkpointing"
    return "activation checkpointing of " + ("every block" if every == 1 else f"1 block in {every}")


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps a number of at least 1."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """"64MiB", "1.5GB", "2048" (bytes) as bytes (binary units either way); ValueError if
    `text` is none of these."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)i?b?\s*", text.lower())
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 64MiB, 1.5GiB, 2048 for bytes)")
    return int(float(match[1]) * _UNITS[match[2]])


def plan(
    build_model: Callable[[], nn.Module], *, world_size: int, sample_input: Any,
    memory_budget: int | str | None = None, loss_fn: LossFn | None = None,
    setups: Sequence[Setup] | None = None, blocks: str | None = None,
    device: torch.device | str | None = None,
) -> list[Plan]:
    """Simulate `setups` (default: `candidates(...)`) of the model `build_model()` builds,
    trained with AdamW on `sample_input` (one rank's batch; `loss_fn(model, input)`, default
    the output's sum), as rank 0 of `world_size` ranks on `device` (default: the
    accelerator if there is one, else the CPU), in this process (no process group may be
    initialised). Peaks are that device's memory. Returns them ranked: those that fit
    `memory_budget` (bytes, or a size such as "4MiB") first, by less recomputation, no
    offload, fewer bytes communicated, lower peak; then those that miss it, nearest first."""
    budget = _budget(memory_budget)
    if dist.is_initialized():
        raise RuntimeError(
            "plan: a process group is initialised here; plan() simulates its own (fake) one. "
            "Call it before init_process_group, or in a separate process."
        )
    on = torch.device(device) if device is not None else _default_device()
    if on.type != "cpu" and on.index is None:
        on = torch.device(on.type, torch.get_device_module(on.type).current_device())
    model = build_model()
    blocks = blocks or _blocks_attribute(model)
    if setups is None:
        setups = candidates(world_size, len(_layers(model, blocks)), offload=on.type != "cpu")
    del model
    plans = [_simulate(build_model, s, world_size, sample_input, loss_fn or _sum, blocks, on)
             for s in setups]
    for p in plans:
        p.fits = None if budget is None else p.peak_bytes <= budget
        p.memory_budget = budget
    return sorted(plans, key=_rank)


def _budget(memory_budget: int | str | None) -> int | None:
    """The budget in bytes. A string is parsed as the command line's --budget is, and here,
    before any simulation: a typo should not cost the minutes of simulating first."""
    if not isinstance(memory_budget, str):
        return memory_budget
    try:
        return parse_size(memory_budget)
    except ValueError as e:
        raise ValueError(f"plan: memory_budget is {e}") from None


def _rank(p: Plan) -> tuple[bool, int, float, bool, int, int]:
    """Plans that fit (or all, without a budget) by cost; those that miss, by how much (a
    miss's other costs matter less than how far it is from fitting)."""
    miss = p.peak_bytes if p.fits is False else 0
    recompute = 1 / p.setup.checkpoint_every if p.setup.checkpoint_every else 0.0
    return p.fits is False, miss, recompute, p.setup.cpu_offload, p.bytes_per_step, p.peak_bytes


def _default_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return torch.device(accelerator.type, 0) if accelerator is not None else torch.device("cpu")


def candidates(world_size: int, num_blocks: int, offload: bool = False) -> list[Setup]:
    """Blocks per unit 1 and 2 (and all of them), reshard_after_forward True, False and (for
    4 ranks or more) half the ranks, checkpointing none, every other block, every block;
    with `offload`, each also with CPU offload."""
    per_unit = sorted({k for k in (1, 2, num_blocks) if 1 <= k <= num_blocks})
    reshard: list[bool | int] = [True, False] + ([world_size // 2] if world_size >= 4 else [])
    return [
        Setup(k, r, c, o) for o in ((False, True) if offload else (False,))
        for k in per_unit for r in reshard for c in (None, 2, 1)
    ]


def _sum(model: nn.Module, batch: Any) -> torch.Tensor:
    output = model(batch)
    return (output if isinstance(output, torch.Tensor) else output[0]).sum()


def _blocks_attribute(model: nn.Module) -> str:
    """The dotted name of the model's largest ModuleList of one class (its blocks)."""
    lists = [
        (len(m), name) for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1
    ]
    if not lists:
        raise ValueError(f"plan: {type(model).__name__} has no ModuleList of blocks; pass blocks=")
    name: str = max(lists)[1]
    return name


def _layers(model: nn.Module, blocks: str) -> nn.ModuleList:
    layers = model.get_submodule(blocks)
    assert isinstance(layers, nn.ModuleList), f"model.{blocks} is not a ModuleList"
    return layers


class _CollectiveBytes(TorchDispatchMode):
    """The buffer bytes of every all-gather and reduce-scatter dispatched while active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if func.namespace == "c10d" and ("allgather" in name or "reduce_scatter" in name):
            # The larger side of (output, input): lists of tensors when coalesced.
            self.nbytes += max(_nbytes(t) for t in args[:2])
        return func(*args, **(kwargs or {}))


def _nbytes(tensors: torch.Tensor | list[torch.Tensor]) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _simulate(
    build_model: Callable[[], nn.Module], setup: Setup, world_size: int, sample_input: Any,
    loss_fn: LossFn, blocks: str, device: torch.device,
) -> Plan:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # no public fake group
    )

    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
    batch = tree_map_only(torch.Tensor, lambda t: t.to(device), sample_input)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = build_model()
        # Named before fully_shard swaps the class for its FSDP<Name> subclass: the printed
        # calls must name the class the user's code has.
        block_class = type(_layers(model, blocks)[0]).__name__
        setup.apply(model, blocks, init_device_mesh(device.type, (world_size,)))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = MemTracker()
        tracker.track_external(model, optim)
        with tracker, warnings.catch_warnings():
            # MemTracker's post-accumulate-grad hook on an unsharded parameter runs after
            # ours took its gradient to reduce (it finds .grad None, and warns); the gradient
            # was tracked when autograd made it, so the peak is right and the warning noise.
            warnings.filterwarnings(
                "ignore", "Expected a tensor or a traceable wrapper-subclass of tensor",
                UserWarning, "torch.distributed._tools.mem_tracker",
            )
            for _ in range(2):  # the second step holds AdamW's state too
                loss_fn(model, batch).backward()
                optim.step()
                optim.zero_grad()
                tracker.reset_mod_stats()  # (per-module statistics; the peak stays)
        peaks = tracker.get_tracker_snapshot("peak")
        peak = int(sum(by_kind["Total"] for d, by_kind in peaks.items() if d.type == device.type))
        with _CollectiveBytes() as counted:
            loss_fn(model, batch).backward()
        optim.zero_grad()
        return Plan(setup, peak, counted.nbytes, None, setup.code(blocks, block_class))
    finally:
        dist.destroy_process_group()
