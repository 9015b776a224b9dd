"""A lower bound of a setup's simulated peak (peak_lower_bound), from ModelSizes measured on
the model unsharded: under a budget, plan() simulates only the setups whose bound is within it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..api.activation_checkpointing import checkpoint_blocks
from .plan_setup import LossFn, Setup, block_list


@dataclasses.dataclass
class ModelSizes:
    """What peak_lower_bound needs of a model, measured on it unsharded."""

    params: int  # every parameter's bytes, once
    trained: int  # those of the parameters that get a gradient (and AdamW's state)
    blocks: tuple[int, ...]  # each block's parameter bytes
    # What a forward and loss leave allocated, by checkpoint_every.
    forward: dict[int | None, int]


def peak_lower_bound(sizes: ModelSizes, setup: Setup, world_size: int) -> int:
    """A lower bound of `setup`'s simulated peak per rank: the largest of three moments every
    simulation passes, counting only memory sure to be on the device (CPU offload moves some)."""
    def sharded(nbytes: int) -> int:  # on the device: none where CPU offload keeps them off
        return 0 if setup.cpu_offload else nbytes // world_size

    moments = sharded(2 * sizes.trained)  # AdamW's, from step 1 on
    # 1. AdamW's step: the shards, their gradients and both moments.
    at_step = sharded(sizes.params + 3 * sizes.trained)
    # 2. A unit computing in the second forward: its parameters whole. (The root's are the
    #    model's outside the blocks; shared ones may make that negative.)
    k = setup.blocks_per_unit
    units = [sum(sizes.blocks[i:i + k]) for i in range(0, len(sizes.blocks), k)]
    units.append(max(0, sizes.params - sum(sizes.blocks)))
    # At one rank the unsharded parameters may be the shards themselves, not a copy.
    computing = moments + max(u + sharded(sizes.params - u) for u in units)
    # 3. The second forward done: what it left allocated and, without resharding, every
    #    block's parameters (reshard_after_forward=<int>'s pieces are not counted).
    kept = sum(sizes.blocks) if setup.reshard_after_forward is False else 0
    left = sizes.forward.get(setup.checkpoint_every, 0)
    return max(at_step, computing, moments + kept + sharded(sizes.params - kept) + left)


def model_sizes(build_model: Callable[[], nn.Module], blocks: str, sample_input: Any,
                loss_fn: LossFn, device: torch.device,
                checkpointing: Iterable[int | None]) -> ModelSizes:
    """The model's ModelSizes (unsharded, one rank's batch), a forward per `checkpointing`."""
    batch = move_batch(sample_input, device)
    model = build_model().to(device)
    params = _param_bytes(model.parameters())
    layers = tuple(_param_bytes(b.parameters()) for b in block_list(model, blocks))
    forward: dict[int | None, int] = {}
    forward[None], loss = _forward_bytes(model, batch, loss_fn, device)
    loss.backward()  # the parameters given a gradient are those that train
    trained = _param_bytes(p for p in model.parameters() if p.grad is not None)
    del model, loss
    for every in {e for e in checkpointing if e is not None}:
        model = build_model().to(device)
        checkpoint_blocks(model, type(block_list(model, blocks)[0]), every=every)
        forward[every], _ = _forward_bytes(model, batch, loss_fn, device)
        del model
    return ModelSizes(params, trained, layers, forward)


def move_batch(sample_input: Any, device: torch.device) -> Any:
    """Make `device` current and move `sample_input`'s tensors there."""
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
    return tree_map_only(torch.Tensor, lambda t: t.to(device), sample_input)


def _forward_bytes(model: nn.Module, batch: Any, loss_fn: LossFn,
                   device: torch.device) -> tuple[int, torch.Tensor]:
    """The bytes a forward and loss leave allocated on `device` (as MemTracker counts), the loss."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = device_total(tracker.get_tracker_snapshot("current"), device)
        loss = loss_fn(model, batch)
        after = device_total(tracker.get_tracker_snapshot("current"), device)
    return after - before, loss


def device_total(snapshot: dict[torch.device, dict[str, int]], device: torch.device) -> int:
    """The bytes a MemTracker snapshot counts on devices of `device`'s type."""
    return int(sum(by_kind["Total"] for d, by_kind in snapshot.items() if d.type == device.type))


def _param_bytes(params: Iterable[nn.Parameter]) -> int:
    # A tied parameter once.
    return sum(p.nbytes for p in {id(p): p for p in params}.values())
