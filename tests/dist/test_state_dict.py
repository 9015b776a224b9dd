"""State dicts: sharded DTensors under the original names; loads of whole or sharded
tensors (also with assign=True); torch.distributed.checkpoint.state_dict unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map_only

from fsdp_compose import fully_shard
from tests.dist.parity import full, per_block
from tests.dist.training import sharded_transformer, train, train_step_matches
from tests.models import Transformer


def check_state_dict_is_sharded_under_original_names() -> None:
    torch.manual_seed(0)
    ref = Transformer()
    model = copy.deepcopy(ref)
    per_block(model, fully_shard)
    sharded_params = dict(model.named_parameters())
    for explicitly_unsharded in (False, True):
        if explicitly_unsharded:
            model.unshard()  # the root unit now holds unsharded parameters
        state = model.state_dict()
        assert list(state) == list(ref.state_dict())
        for key, value in state.items():
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), key
            assert torch.equal(value.full_tensor(), ref.state_dict()[key]), key
    kept = model.state_dict(keep_vars=True)  # still unsharded: the parameters' sharded form
    assert all(kept[fqn] is p for fqn, p in sharded_params.items())


def test_state_dict_is_sharded_under_original_names(ranks):
    ranks.run(check_state_dict_is_sharded_under_original_names, world_size=2)


def check_load_whole_and_sharded_tensors() -> None:
    torch.manual_seed(0)
    ref = Transformer()
    whole = {k: v.clone() for k, v in ref.state_dict().items()}
    sharded = sharded_transformer(0).state_dict()
    for source, assign in ((whole, False), (sharded, False), (whole, True), (sharded, True)):
        model = sharded_transformer(seed=1)  # other values, replaced by the load
        model.unshard()  # a load reshards first: the unsharded data would be stale
        model.load_state_dict(copy.copy(source), assign=assign)
        for fqn, p in model.named_parameters():
            assert isinstance(p, DTensor), fqn
            assert torch.equal(full(p), whole[fqn]), (fqn, assign)
        # Training reads what was loaded: the gathers see the new shards.
        train_step_matches(model, copy.deepcopy(ref))


def test_load_whole_and_sharded_tensors(ranks):
    ranks.run(check_load_whole_and_sharded_tensors, world_size=2)


def check_load_errors_name_key_and_shapes() -> None:
    model = sharded_transformer(0)
    wrong = {k: v.full_tensor() for k, v in model.state_dict().items()}
    wrong["head.weight"] = torch.zeros(5, 12)
    with pytest.raises(RuntimeError, match=r"(?s)size mismatch for head\.weight: copying a param "
                       r"with shape torch\.Size\(\[5, 12\]\).* torch\.Size\(\[31, 12\]\)"):
        model.load_state_dict(wrong)
    del wrong["head.weight"]
    wrong["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\) in state_dict: \"head\.weight\".*"
                       r"Unexpected key\(s\) in state_dict: \"extra\""):
        model.load_state_dict(wrong)


def test_load_errors_name_key_and_shapes(ranks):
    ranks.run(check_load_errors_name_key_and_shapes, world_size=2)


def check_distributed_state_dict_round_trips(full_state_dict: bool) -> None:
    """get_state_dict / set_state_dict of model and optimizer, sharded or whole: restoring
    and repeating a step gives bit-identical parameters."""
    options = StateDictOptions(
        full_state_dict=full_state_dict, broadcast_from_rank0=full_state_dict
    )
    model = sharded_transformer(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    # Cloned, as a save to disk would: state dicts alias the live parameters and steps.
    model_state, optim_state = tree_map_only(
        torch.Tensor, torch.clone, get_state_dict(model, optim, options=options)
    )
    if full_state_dict:
        assert not isinstance(model_state["head.weight"], DTensor)
        if dist.get_rank() != 0:  # broadcast_from_rank0 loads need rank 0's copy only
            model_state, optim_state = {}, {}
    train(model, optim, range(2, 3))
    after = {fqn: full(p).clone() for fqn, p in model.named_parameters()}

    restored = sharded_transformer(seed=1)
    restored_optim = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    # Separately: set_state_dict skips the model on ranks given an empty model state, so
    # with broadcast_from_rank0 they would miss rank 0's broadcast.
    set_model_state_dict(restored, model_state, options=options)
    set_optimizer_state_dict(restored, restored_optim, optim_state, options=options)
    train(restored, restored_optim, range(2, 3))
    for fqn, p in restored.named_parameters():
        assert torch.equal(full(p), after[fqn]), fqn


def test_distributed_state_dict_round_trips(ranks):
    ranks.run(check_distributed_state_dict_round_trips, world_size=2, full_state_dict=False)
    ranks.run(check_distributed_state_dict_round_trips, world_size=2, full_state_dict=True)


def check_full_state_dict_memory_is_one_parameter() -> tuple[int, int]:
    """A whole state dict on rank 0's CPU: other ranks keep nothing, and the peak is the
    result plus about one parameter whole, never the whole model twice."""
    model = sharded_transformer(0, dim=32, depth=4, vocab=64)
    largest = max(p.numel() for p in model.parameters()) * 4
    total = sum(p.numel() for p in model.parameters()) * 4
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        baseline = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - baseline
    result = total if dist.get_rank() == 0 else 0
    assert len(state) == (len(model.state_dict()) if dist.get_rank() == 0 else 0)
    assert peak <= result + 2 * largest, (peak, result, largest)
    return peak, total


def test_full_state_dict_memory_is_one_parameter(ranks):
    ranks.run(check_full_state_dict_memory_is_one_parameter, world_size=2)
