"""Sharding strategies: HSDP on a 2-D mesh and replicate-only units, alone and mixed."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

from fsdp_compose import fully_shard, replicate
from tests.dist.checks import check_hsdp_accumulation_without_all_reduce
from tests.dist.counting import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    CollectiveCounter,
    first_forward,
)
from tests.dist.parity import (
    max_diff_to,
    per_block,
    train_and_compare,
)
from tests.models import MLP, Transformer, feature_batch, lm_loss, mse_loss, token_batch


def check_hsdp() -> list[tuple[float, float]]:
    errors = [
        tuple(train_and_compare(MLP, mse_loss, feature_batch, mesh_shape=(2, 2),
                                reshard_after_forward=reshard))
        for reshard in (True, False)
    ]
    errors.append(tuple(train_and_compare(Transformer, lm_loss, token_batch, mesh_shape=(2, 2))))
    return errors


def check_hsdp_on_an_unnamed_mesh() -> tuple[float, list[str]]:
    """A 2-D mesh without names (torch's fully_shard refuses it): dim 0 replicates, dim 1
    shards. Trains like single-process; ours in both seats of the comparison."""
    unnamed = init_device_mesh("cpu", (2, 2))
    errors = train_and_compare(
        MLP, mse_loss, feature_batch, shard_fns=(fully_shard, fully_shard),
        wrap=lambda m, shard: per_block(m, shard, mesh=unnamed),
    )
    model = MLP()
    per_block(model, fully_shard, mesh=unnamed)
    return errors.vs_reference, sorted({str(p.placements) for p in model.parameters()})


def test_hsdp_on_an_unnamed_mesh(ranks):
    for vs_reference, placements in ranks.run(check_hsdp_on_an_unnamed_mesh, world_size=4):
        assert vs_reference < 1e-6
        assert placements == ["(Replicate(), Shard(dim=0))"]


def test_hsdp_trains_like_single_process_and_torch(ranks):
    for errors in ranks.run(check_hsdp, world_size=4):
        assert all(vs_torch == 0.0 for _, vs_torch in errors), errors


def check_hsdp_placements_and_collectives() -> Counter:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = MLP()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for fqn, p in model.named_parameters():
        assert p.placements == (Replicate(), Shard(0)), fqn
    first_forward(model, feature_batch(0, 2))
    with CollectiveCounter() as comms:
        mse_loss(model, feature_batch(0, 2)).backward()
    return comms.counts


def test_hsdp_reduce_scatters_then_all_reduces_once_per_unit(ranks):
    counts = ranks.run(check_hsdp_placements_and_collectives, world_size=4)[0]
    # 4 layer units (the root holds no parameters): gathered in forward and again in
    # backward, one reduce-scatter in the shard group and one all-reduce across replicas.
    assert counts == {ALL_GATHER: 8, REDUCE_SCATTER: 4, ALL_REDUCE: 4}


def replicate_like_torch(module, mesh, **kwargs):
    """torch's fully_shard on a (replicas, 1) mesh: what replicate() builds."""
    grid = init_device_mesh("cpu", (mesh.size(), 1), mesh_dim_names=("replicate", "shard"))
    return torch_fully_shard(module, mesh=grid, reshard_after_forward=False, **kwargs)


def check_replicate() -> list[tuple[float, float]]:
    return [
        tuple(train_and_compare(make_model, loss, batch,
                                shard_fns=(replicate, replicate_like_torch),
                                torch_differs=REPLICATE_DIFFERS))
        for make_model, loss, batch in ((MLP, mse_loss, feature_batch),
                                        (Transformer, lm_loss, token_batch))
    ]


# torch's fully_shard treats a one-rank shard group with its own division order, so the
# two agree to float32 rounding (a few ulps after several AdamW steps), not bit for bit.
REPLICATE_VS_TORCH = 1e-6
REPLICATE_DIFFERS = "torch divides a one-rank shard group's gradients in another order"


def test_replicate_trains_like_single_process_and_torch_at_2_ranks(ranks):
    for errors in ranks.run(check_replicate, world_size=2):
        assert all(vs_torch <= REPLICATE_VS_TORCH for _, vs_torch in errors), errors


def test_replicate_trains_like_single_process_and_torch_at_4_ranks(ranks):
    for errors in ranks.run(check_replicate, world_size=4):
        assert all(vs_torch <= REPLICATE_VS_TORCH for _, vs_torch in errors), errors


def check_replicate_collectives() -> Counter:
    model = MLP()
    for layer in model.layers:
        replicate(layer)
    replicate(model)
    first_forward(model, feature_batch(0, 2))
    with CollectiveCounter() as comms:
        mse_loss(model, feature_batch(0, 2)).backward()
    assert all(p.placements == (Replicate(), Shard(0)) and p.to_local().shape == p.shape
               for p in model.parameters())
    return comms.counts


def test_replicate_sends_one_all_reduce_per_unit_and_no_gathers(ranks):
    assert ranks.run(check_replicate_collectives, world_size=2)[0] == {ALL_REDUCE: 4}


def blocks_sharded_root_replicated(model: nn.Module, shard) -> None:
    for block in model.blocks:
        shard(block)
    grid = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("r", "s"))
    shard(model, mesh=grid, reshard_after_forward=False)


def check_mixed_strategies() -> tuple[float, float]:
    return tuple(train_and_compare(Transformer, lm_loss, token_batch,
                                   wrap=blocks_sharded_root_replicated,
                                   torch_differs=REPLICATE_DIFFERS))


def test_sharded_and_replicated_units_in_one_model(ranks):
    _, vs_torch = ranks.run(check_mixed_strategies, world_size=4)[0]
    assert vs_torch <= REPLICATE_VS_TORCH  # the root is replicated: see REPLICATE_VS_TORCH


def test_hsdp_accumulation_without_all_reduce(ranks):
    ranks.run(check_hsdp_accumulation_without_all_reduce, world_size=4)


def check_reshard_to_smaller_group() -> list[tuple[float, float]]:
    return [
        tuple(train_and_compare(MLP, mse_loss, feature_batch, reshard_after_forward=2)),
        tuple(train_and_compare(Transformer, lm_loss, token_batch, reshard_after_forward=2)),
    ]


def test_reshard_after_forward_to_a_smaller_group_trains_like_torch(ranks):
    for errors in ranks.run(check_reshard_to_smaller_group, world_size=4):
        assert all(vs_torch == 0.0 for _, vs_torch in errors), errors


def check_smaller_group_collectives() -> tuple[Counter, Counter]:
    """Group sizes of the all-gathers: forward over all 4 ranks, backward over pairs."""
    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=2)
    fully_shard(model)
    x = feature_batch(0, 2)
    first_forward(model, x)
    sizes = []
    for phase in ("forward", "backward"):
        with CollectiveCounter() as comms:
            if phase == "forward":
                loss = mse_loss(model, x)
            else:
                loss.backward()
        sizes.append(comms.group_sizes)
    return tuple(sizes)


def test_reshard_after_forward_int_gathers_backward_in_the_smaller_group(ranks):
    forward, backward = ranks.run(check_smaller_group_collectives, world_size=4)[0]
    assert forward == {(ALL_GATHER, 4): 4}
    assert backward == {(ALL_GATHER, 2): 4, (REDUCE_SCATTER, 4): 4}


def check_int_edge_values() -> list[int]:
    """1 is False (with a warning) and the shard size is True: count backward gathers."""
    counts = []
    for value in (1, 4, 2):
        torch.manual_seed(0)
        model = MLP()
        for layer in model.layers:
            if value == 1:
                with pytest.warns(UserWarning, match="reshard_after_forward=1 keeps the whole"):
                    fully_shard(layer, reshard_after_forward=1)
            else:
                fully_shard(layer, reshard_after_forward=value)
        fully_shard(model)
        loss = mse_loss(model, feature_batch(0, 2))
        with CollectiveCounter() as comms:
            loss.backward()
        counts.append(comms.counts[ALL_GATHER])
    return counts


def test_reshard_after_forward_1_and_shard_size_mean_false_and_true(ranks):
    assert ranks.run(check_int_edge_values, world_size=4)[0] == [0, 4, 4]


def check_setter_switches_to_smaller_group() -> Counter:
    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.set_reshard_after_forward(2)  # recurses; the root (no parameters) is unaffected
    loss = mse_loss(model, feature_batch(0, 2))
    with CollectiveCounter() as comms:
        loss.backward()
    return comms.group_sizes


def test_set_reshard_after_forward_int(ranks):
    backward = ranks.run(check_setter_switches_to_smaller_group, world_size=4)[0]
    assert backward == {(ALL_GATHER, 2): 4, (REDUCE_SCATTER, 4): 4}


def check_replicate_over_a_dim_of_a_larger_mesh() -> float:
    """replicate(mesh=mesh["dp"]) of a (dp, tp) mesh: the ranks outside each dp group build
    no other groups (no hang), and gradients average over the dp group only."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    replicate(model, mesh=dp)
    batch = feature_batch(mesh.get_local_rank("tp"), 4)  # the dp group's data; tp groups differ
    mse_loss(model, batch.chunk(2)[dp.get_local_rank()]).backward()
    mse_loss(ref, batch).backward()
    return max_diff_to(model, ref, grads=True)


def test_replicate_over_a_dim_of_a_larger_mesh(ranks):
    diffs = ranks.run(check_replicate_over_a_dim_of_a_larger_mesh, world_size=4)
    assert all(d < 1e-6 for d in diffs)
