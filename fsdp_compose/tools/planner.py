"""plan(): try candidate setups of a model in one process before running it, and rank them.
Each trains two AdamW steps as rank 0 of a fake process group, under MemTracker (the peak)."""

from __future__ import annotations

import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .plan_bound import ModelSizes, device_total, model_sizes, move_batch, peak_lower_bound
from .plan_setup import LossFn, Plan, Setup, block_list, parse_size, size

__all__ = ["LossFn", "ModelSizes", "Plan", "Setup", "candidates", "model_sizes", "parse_size",
           "peak_lower_bound", "plan", "ranking", "size", "table"]


def plan(build_model: Callable[[], nn.Module], *, world_size: int, sample_input: Any,
         memory_budget: int | str | None = None, loss_fn: LossFn | None = None,
         setups: Sequence[Setup] | None = None, blocks: str | None = None,
         device: torch.device | str | None = None, quiet: bool = False) -> list[Plan]:
    """Simulate `setups` (default: candidates()) of `build_model()`, trained with AdamW on one
    rank's batch `sample_input` (loss: `loss_fn(model, input)`, default the output's sum), as
    rank 0 of `world_size` on `device` (default: the accelerator, else the CPU), in this process,
    which must have no process group. Under `memory_budget` (bytes or "4MiB"), a setup whose
    peak_lower_bound exceeds it is not simulated. Ranked as ranking() says; progress on stderr."""
    try:  # before any simulation: a typo costs no minutes
        budget = parse_size(memory_budget) if isinstance(memory_budget, str) else memory_budget
    except ValueError as e:
        raise ValueError(f"plan: memory_budget is {e}") from None
    if dist.is_initialized():
        raise RuntimeError("plan: a process group is initialised here; plan() simulates its own "
                           "(fake) one. Call it before init_process_group, or in a separate "
                           "process.")
    on = _device(device)
    model = build_model()
    if not blocks:  # the dotted name of the model's largest ModuleList of one class
        lists = [(len(m), name) for name, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1]
        if not lists:
            raise ValueError(f"plan: {type(model).__name__} has no ModuleList of blocks; "
                             "pass blocks=")
        blocks = str(max(lists)[1])
    layers = block_list(model, blocks)
    # Named before fully_shard makes it FSDP<Name>: the printed calls name the user's class.
    block_class = type(layers[0]).__name__
    if setups is None:
        setups = candidates(world_size, len(layers), offload=on.type != "cpu")
    del model, layers
    loss_fn = loss_fn or _sum
    progress, plans, sizes = Progress(len(setups), quiet), [], None
    if budget is not None:
        try:
            sizes = model_sizes(build_model, blocks, sample_input, loss_fn, on,
                                {s.checkpoint_every for s in setups})
        except (RuntimeError, NotImplementedError) as e:  # OutOfMemoryError is a RuntimeError
            # The unsharded model cannot run here: too large for the device, or parameters on
            # the meta device that only fully_shard initialises.
            progress.say("plan: no lower bounds, every setup simulated: the unsharded model "
                         f"failed ({e})", end="\n")
    for k, setup in enumerate(setups, 1):
        code = setup.code(blocks, block_class)
        least = 0 if sizes is None else peak_lower_bound(sizes, setup, world_size)
        if budget is not None and least > budget:
            progress.show(k, f"not simulated (peak at least {size(least)}, over the budget): "
                             f"{setup.describe()}")
            plans.append(Plan(setup, least, None, False, code, budget, simulated=False))
            continue
        progress.show(k, f"simulating {setup.describe()}")
        peak, sent = _simulate(build_model, setup, world_size, sample_input, loss_fn, blocks, on)
        fits = None if budget is None else peak <= budget
        plans.append(Plan(setup, peak, sent, fits, code, budget))
    progress.finish(sum(not p.simulated for p in plans))
    return sorted(plans, key=_rank)


def _rank(p: Plan) -> tuple[bool, bool, int, float, bool, int, int]:
    """Fits (all, without a budget) by cost; then misses, nearest first; then bounds, lowest."""
    miss = p.peak_bytes if p.fits is False else 0
    recompute = 1 / p.setup.checkpoint_every if p.setup.checkpoint_every else 0.0
    return (p.fits is False, not p.simulated, miss, recompute, p.setup.cpu_offload,
            p.bytes_per_step or 0, p.peak_bytes)


def table(plans: Sequence[Plan]) -> str:
    """`plans` as aligned columns: setup, peak, bytes per step, (under a budget) verdict."""
    budgeted = any(p.fits is not None for p in plans)
    # Without a budget every verdict is "", and rstrip() drops its column.
    rows = [["setup", "peak per rank", "communicated per step", "verdict" if budgeted else ""]]
    rows += [[p.setup.describe(), p.peak_words(), "(not simulated)" if p.bytes_per_step is None
              else size(p.bytes_per_step), p.verdict()] for p in plans]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def ranking(budgeted: bool) -> str:
    """How plan() orders its plans (_rank), in words."""
    costs = ("by less recomputation (a smaller share of blocks checkpointed), then no CPU "
             "offload, then fewer bytes communicated, then a lower peak")
    return f"Ranked {costs}." if not budgeted else (
        f"Ranked: the setups that fit the budget first, {costs}; then those over it, the lowest "
        "simulated peak (the nearest miss) first; last, those a lower bound of the peak rules "
        "out without simulating, the lowest bound first.")


def _device(device: torch.device | str | None) -> torch.device:
    """`device` with its index, else the accelerator's first, else the CPU."""
    if device is None:
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        return torch.device(accelerator.type, 0) if accelerator is not None else torch.device("cpu")
    on = torch.device(device)
    if on.type != "cpu" and on.index is None:
        on = torch.device(on.type, torch.get_device_module(on.type).current_device())
    return on


def candidates(world_size: int, num_blocks: int, offload: bool = False) -> list[Setup]:
    """Blocks per unit 1, 2, all; reshard_after_forward True, False, (from 4 ranks) world_size/2;
    checkpointing none, every other, every block; with `offload` (on a GPU), each offloaded too."""
    per_unit = sorted({k for k in (1, 2, num_blocks) if 1 <= k <= num_blocks})
    reshard: list[bool | int] = [True, False] + ([world_size // 2] if world_size >= 4 else [])
    return [Setup(k, r, c, o) for o in ((False, True) if offload else (False,))
            for k in per_unit for r in reshard for c in (None, 2, 1)]


def _sum(model: nn.Module, batch: Any) -> torch.Tensor:
    output = model(batch)
    return (output if isinstance(output, torch.Tensor) else output[0]).sum()


class _CollectiveBytes(TorchDispatchMode):
    """The buffer bytes of every all-gather and reduce-scatter dispatched while active."""

    nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if func.namespace == "c10d" and ("allgather" in name or "reduce_scatter" in name):
            # The larger side of (output, input): lists of tensors when coalesced.
            self.nbytes += max(sum(t.nbytes for t in tree_leaves(side)) for side in args[:2])
        return func(*args, **(kwargs or {}))


def _simulate(build_model: Callable[[], nn.Module], setup: Setup, world_size: int,
              sample_input: Any, loss_fn: LossFn, blocks: str,
              device: torch.device) -> tuple[int, int]:
    """`setup`'s peak per rank and bytes communicated per step."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore  # no public fake group

    batch = move_batch(sample_input, device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = build_model()
        setup.apply(model, blocks, init_device_mesh(device.type, (world_size,)))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = MemTracker()
        tracker.track_external(model, optim)
        with tracker, warnings.catch_warnings():
            # MemTracker's post-accumulate-grad hook runs after ours took the unsharded
            # gradient (it finds .grad None and warns); it tracked the gradient when autograd
            # made it, so the peak is right.
            warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass",
                                    UserWarning, "torch.distributed._tools.mem_tracker")
            for _ in range(2):  # the second step holds AdamW's state too
                loss_fn(model, batch).backward()
                optim.step()
                optim.zero_grad()
                tracker.reset_mod_stats()  # (per-module statistics; the peak stays)
        peak = device_total(tracker.get_tracker_snapshot("peak"), device)
        with _CollectiveBytes() as counted:  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
            loss_fn(model, batch).backward()
        optim.zero_grad()
        return peak, counted.nbytes
    finally:
        dist.destroy_process_group()


class Progress:
    """Which candidate plan() is on, on stderr: a line each, or on a terminal one with a bar."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.started = total, time.monotonic()
        # Looked up at the call, not import: tests and callers redirect it. None: say nothing.
        self.stream: TextIO | None = None if quiet else sys.stderr
        self.tty = self.stream is not None and self.stream.isatty()

    def show(self, k: int, what: str) -> None:
        line = f"candidate {k} of {self.total}, {time.monotonic() - self.started:.1f} s: {what}"
        done = 20 * (k - 1) // self.total
        self.say(f"[{'#' * done}{'.' * (20 - done)}] {line}" if self.tty else f"plan: {line}")

    def finish(self, ruled_out: int) -> None:
        self.say(f"plan: {self.total} setups in {time.monotonic() - self.started:.1f} s, "
                  f"{ruled_out} ruled out by a lower bound without simulating", end="\n")

    def say(self, line: str, end: str = "") -> None:
        # On a terminal, over the last line (`end` "\n" ends it), cut to the terminal's
        # width: a line that wraps cannot be rewritten by \r.
        if self.tty:
            width = shutil.get_terminal_size().columns - 1
            print("\r" + line[:width].ljust(width), end=end, file=self.stream, flush=True)
        elif self.stream is not None:
            print(line, file=self.stream, flush=True)
