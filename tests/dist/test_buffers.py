"""Memory that adds up: every buffer the runtime holds beyond the shards, by kind
(fsdp_compose/unit/held.py), sampled at every collective it issues and waits for during
training steps, stays within its analytic bound, and between steps nothing is held at all.
Independently of that accounting, no tensor storage made during the steps outlives them
but the parameters' shards, their gradients and the optimizer's state. In steady steps
the runtime allocates only the gradients: every other buffer is reused."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import fully_shard
from fsdp_compose.comm import process_wide
from fsdp_compose.schedule.iteration import state_of
from fsdp_compose.unit.held import (
    GATHERED,
    GRADIENT_LEDGER,
    KINDS,
    POST_FORWARD,
    REDUCE_INPUT,
    REDUCE_OUTPUT,
    UNSHARDED,
)
from tests.dist.parity import per_block
from tests.models import Transformer, lm_loss, token_batch

STEPS = 3


def padded_bytes(params: Iterator[torch.nn.Parameter], world: int) -> int:
    """Unsharded bytes as gathered: each parameter padded to `world` dim-0 shards."""
    return sum(-(-p.shape[0] // world) * world * p[0].numel() * p.element_size() for p in params)


class Sampler:
    """An observer that adds up every unit's held bytes, by kind, at each event."""

    def __init__(self, units: list) -> None:
        self.units = units
        self.peak = dict.fromkeys(KINDS, 0)

    def held(self) -> dict[str, int]:
        total = dict.fromkeys(KINDS, 0)
        for unit in self.units:
            for kind, nbytes in unit.held_by_kind().items():
                total[kind] += nbytes
        return total

    def sample(self, *args: object, **kwargs: object) -> None:
        for kind, nbytes in self.held().items():
            self.peak[kind] = max(self.peak[kind], nbytes)

    begin = end = backward_began = backward_done = sample


def storages(tensors: Iterator[object]) -> dict[int, int]:
    """Data pointer to bytes of the plain tensors' storages among `tensors`."""
    found = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type == "cpu":
            storage = t.untyped_storage()
            if storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def owned(model: torch.nn.Module, optim: torch.optim.Optimizer) -> set[int]:
    """The storages that should outlive a step: shards, gradients, optimizer state, and the
    rank tensors of the device meshes made for the model."""
    tensors = [local(p) for p in model.parameters()]
    tensors += [m.mesh for m in gc.get_objects() if isinstance(m, DeviceMesh)]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for state in optim.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors}


def check_buffers() -> dict[str, object]:
    world = dist.get_world_size()
    gc.collect()
    before = storages(gc.get_objects())
    torch.manual_seed(0)
    model = Transformer(depth=4)
    per_block(model, fully_shard)
    units = [state_of(m).unit for m in (*model.blocks, model)]
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler, between = Sampler(units), []
    for step in range(STEPS):
        process_wide.observe(sampler)
        try:
            lm_loss(model, token_batch(step, 2)).backward()
        finally:
            process_wide.observe(None)
        between.append(sampler.held())
        optim.step()
        if step < STEPS - 1:
            optim.zero_grad()
    gc.collect()
    left = {ptr: n for ptr, n in storages(gc.get_objects()).items()
            if ptr not in before and ptr not in owned(model, optim)}
    blocks = max(padded_bytes(b.parameters(), world) for b in model.blocks)
    root_params = (p for n, p in model.named_parameters() if not n.startswith("blocks."))
    root = padded_bytes(root_params, world)
    return {"peak": sampler.peak, "between": between, "left": left, "world": world,
            "largest": max(blocks, root), "blocks": blocks, "root": root,
            "shards": padded_bytes(model.parameters(), world) // world}


def test_buffers_stay_within_their_bounds_and_none_outlives_a_step(ranks):
    for r in ranks.run(check_buffers, world_size=2):
        peak, largest = r["peak"], r["largest"]
        # The root stays unsharded through the step; one block computes, one is prefetched.
        assert r["root"] < peak[UNSHARDED] <= r["root"] + 2 * r["blocks"], peak
        # One unit's all-gather in flight, another's being copied out.
        assert 0 < peak[GATHERED] <= 2 * largest, peak
        assert peak[POST_FORWARD] == 0, peak
        assert 0 < peak[REDUCE_INPUT] <= 2 * largest, peak  # reductions in flight
        assert 0 < peak[REDUCE_OUTPUT] <= 2 * largest // r["world"], peak
        # This backward's reduced shards, until it ends: the gradients, at most.
        assert 0 < peak[GRADIENT_LEDGER] <= r["shards"], peak
        for held in r["between"]:  # after backward, before the optimizer: nothing
            assert not any(held.values()), held
        assert not r["left"], f"storages outliving the steps: {r['left']}"


ALLOCATIONS = ("aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
               "aten::zeros", "aten::new_zeros", "aten::empty_like", "aten::zeros_like")


class Allocations(TorchDispatchMode):
    """Tensors allocated by factory ops (with memory: an empty one takes none), and storages
    resized, while active."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors = 0
        self.resizes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors += func._schema.name in ALLOCATIONS and out.numel() > 0
        return out

    def __enter__(self) -> Allocations:
        resize = self._resize = torch.UntypedStorage.resize_

        def counted(storage: torch.UntypedStorage, nbytes: int) -> object:
            self.resizes += 1
            return resize(storage, nbytes)

        torch.UntypedStorage.resize_ = counted
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)


def count_allocations() -> list[tuple[int, int, int]]:
    """Per step: tensors fsdp_compose's step allocates beyond the plain model's, and storage
    resizes; with the number of reduce-scatters."""
    torch.manual_seed(0)
    plain, model = Transformer(depth=4), Transformer(depth=4)
    per_block(model, fully_shard)
    counts = []
    for step in range(4):
        for m in (plain, model):
            with Allocations() as allocations:
                lm_loss(m, token_batch(step, 2)).backward()
            m.zero_grad()
            if m is plain:
                plain_tensors = allocations.tensors
        counts.append((allocations.tensors - plain_tensors, allocations.resizes))
    return counts[1:]  # the first step lays out and checks once


def test_steady_steps_allocate_only_the_gradients(ranks):
    units, gathers = 5, 2 * 4 + 1  # blocks gather in forward and backward, the root once
    for counts in ranks.run(count_allocations, world_size=2):
        # One new tensor per reduction: its output becomes the sharded .grads (zero_grad
        # freed the last). Every other buffer is reused: its storage grows for a use and
        # shrinks after it (per gather the all-gather's output and the unsharded data, per
        # reduction the reduce-scatter's input).
        assert counts == [(units, 4 * gathers + 2 * units)] * 3, counts
