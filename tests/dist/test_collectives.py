"""Collectives per unit and pass, counted for fsdp_compose and torch's fully_shard alike."""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_compose import fully_shard
from tests.dist.counting import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter, first_forward
from tests.models import Transformer, lm_loss, token_batch


class Counts(NamedTuple):
    forward_all_gathers: int
    backward_all_gathers: int
    reduce_scatters: int


def count_step(model: torch.nn.Module, forwards: int) -> Counts:
    tokens = token_batch(0, 2)
    first_forward(model, tokens[:, :-1])
    with CollectiveCounter() as comms:
        loss = sum(lm_loss(model, tokens) for _ in range(forwards))
        forward = dict(comms.counts)
        loss.backward()
        total = comms.counts
    assert set(total) <= {ALL_GATHER, REDUCE_SCATTER}, total
    return Counts(
        forward.get(ALL_GATHER, 0),
        total[ALL_GATHER] - forward.get(ALL_GATHER, 0),
        total[REDUCE_SCATTER] - forward.get(REDUCE_SCATTER, 0),
    )


def check_counts(reshard_after_forward: bool, forwards: int) -> tuple[Counts, Counts]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ours = Transformer(depth=3)  # 3 block units + the root unit
    theirs = copy.deepcopy(ours)
    for model, shard in ((ours, fully_shard), (theirs, torch_fully_shard)):
        for block in model.blocks:
            shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        shard(model, mesh=mesh)
    return count_step(ours, forwards), count_step(theirs, forwards)


@pytest.mark.torch_values_unused("counts collectives and bytes against torch's")
def test_one_all_gather_per_unit_and_one_reduce_scatter_per_backward(ranks):
    ours, theirs = ranks.run(check_counts, reshard_after_forward=True, forwards=1)[0]
    # Forward gathers all 4 units; backward re-gathers the 3 resharded blocks, not the
    # root (which keeps its parameters); each unit reduces once.
    assert ours == Counts(4, 3, 4) == theirs


@pytest.mark.torch_values_unused("counts collectives against torch's")
def test_no_backward_all_gather_without_reshard_after_forward(ranks):
    ours, theirs = ranks.run(check_counts, reshard_after_forward=False, forwards=1)[0]
    assert ours == Counts(4, 0, 4) == theirs


@pytest.mark.torch_values_unused("counts collectives against torch's")
def test_two_forwards_reduce_each_unit_once(ranks):
    ours, theirs = ranks.run(check_counts, reshard_after_forward=True, forwards=2)[0]
    # The second forward gathers the 3 resharded blocks again (the root stayed unsharded);
    # backward gathers each block once and keeps it until both forwards' backward ran,
    # then reduces once: one collective fewer per block than torch's fully_shard.
    assert ours == Counts(7, 3, 4)
    assert theirs.forward_all_gathers == 7 and theirs.reduce_scatters >= 4


def check_embedding_not_unsharded_in_backward() -> tuple[Counts, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = Transformer(depth=1)
    ours = copy.deepcopy(ref)
    fully_shard(ours.tok_emb, mesh=mesh)  # embedding backward never reads the weight
    fully_shard(ours, mesh=mesh)
    ours.tok_emb.set_unshard_in_backward(False)
    tokens = token_batch(0, 2 * world)
    lm_loss(ref, tokens).backward()
    first_forward(ours, tokens[:, :-1])
    with CollectiveCounter() as comms:
        lm_loss(ours, tokens.chunk(world)[rank]).backward()
    grad = ours.tok_emb.weight.grad.full_tensor()
    torch.testing.assert_close(grad, ref.tok_emb.weight.grad)
    return Counts(comms.counts[ALL_GATHER], 0, comms.counts[REDUCE_SCATTER])


def test_unshard_in_backward_false_skips_the_backward_all_gather(ranks):
    counts = ranks.run(check_embedding_not_unsharded_in_backward)[0]
    # Forward gathers both units; backward gathers neither (the root kept its parameters,
    # the embedding is not needed), and both reduce.
    assert counts == Counts(2, 0, 2)


def check_setter_turns_off_reshard_after_forward() -> tuple[Counts, Counts]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Transformer(depth=3)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = count_step(model, forwards=1)
    model.set_reshard_after_forward(False)  # recurses into the blocks
    return before, count_step(model, forwards=1)


def test_set_reshard_after_forward_false_skips_backward_all_gathers(ranks):
    before, after = ranks.run(check_setter_turns_off_reshard_after_forward)[0]
    assert (before, after) == (Counts(4, 3, 4), Counts(4, 0, 4))
