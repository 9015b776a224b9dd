"""Checkpoints: resume bit-identical to uninterrupted training, reshard on load across world
sizes, atomic saves, clear errors, and a safetensors export of the whole weights."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_compose import fully_shard, load_checkpoint, save_checkpoint, save_full_state_dict
from tests.dist.parity import full, per_block
from tests.dist.training import new_run, sharded_transformer, train, whole_state
from tests.models import MLP, Transformer


def check_resume_is_bit_identical(path: str) -> None:
    model, optim = new_run(seed=0)
    train(model, optim, range(4))
    uninterrupted = whole_state(model, optim)

    model, optim = new_run(seed=0)
    train(model, optim, range(2))
    save_checkpoint(path, model, optim, step=2)
    model, optim = new_run(seed=1)  # a fresh process would start from other values
    step = load_checkpoint(path, model, optim)
    assert step == 2
    train(model, optim, range(step, 4))
    resumed = whole_state(model, optim)
    assert list(resumed) == list(uninterrupted)
    for key, value in resumed.items():
        assert torch.equal(value, uninterrupted[key]), key


def test_resume_is_bit_identical(ranks, tmp_path):
    ranks.run(check_resume_is_bit_identical, world_size=2, path=str(tmp_path / "ckpt"))


def check_save(path: str) -> dict[str, list]:
    model, optim = new_run(seed=0)
    train(model, optim, range(2))
    save_checkpoint(path, model, optim, step=2)
    # As lists: tensors in the result queue would travel as shared-memory handles.
    return {key: value.tolist() for key, value in whole_state(model, optim).items()}


def check_load(path: str, saved: dict[str, list]) -> None:
    model, optim = new_run(seed=1)
    assert load_checkpoint(path, model, optim) == 2
    loaded = whole_state(model, optim)
    assert list(loaded) == list(saved)
    for key, value in loaded.items():  # float32 -> Python float -> float32 is exact
        assert torch.equal(value, torch.tensor(saved[key], dtype=value.dtype)), key


def test_load_at_other_world_sizes(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks.run(check_save, world_size=4, path=path)[0]
    ranks.run(check_load, world_size=2, path=path, saved=saved)
    ranks.run(check_load, world_size=1, path=path, saved=saved)


def check_crash_mid_save_keeps_previous_checkpoint(path: str) -> None:
    model, optim = new_run(seed=0)
    save_checkpoint(path, model, optim, step=0)
    before = whole_state(model, optim)
    train(model, optim, range(1))
    # The metadata write fails after every rank wrote its shards; every rank hears of it.
    with mock.patch.object(FileSystemWriter, "finish", side_effect=OSError("disk full")):
        with pytest.raises(CheckpointException) as failed:
            save_checkpoint(path, model, optim, step=1)
    errors = {rank: str(error) for rank, (error, _) in failed.value.failures.items()}
    assert errors == {0: "disk full"}
    assert Path(path + ".incomplete").is_dir() and not Path(path + ".incomplete/.metadata").exists()
    with pytest.raises(FileNotFoundError, match=r"is not a complete checkpoint \(no \.metadata\)"
                       r"; a save into it was interrupted"):
        load_checkpoint(path + ".incomplete", *new_run(seed=1))
    restored, restored_optim = new_run(seed=1)
    assert load_checkpoint(path, restored, restored_optim) == 0  # the previous one, intact
    assert all(torch.equal(v, before[k]) for k, v in whole_state(restored, restored_optim).items())
    save_checkpoint(path, model, optim, step=1)  # the next save succeeds and replaces it
    assert load_checkpoint(path, restored, restored_optim) == 1
    assert not Path(path + ".incomplete").exists()


def test_crash_mid_save_keeps_previous_checkpoint(ranks, tmp_path):
    ranks.run(check_crash_mid_save_keeps_previous_checkpoint, world_size=2,
              path=str(tmp_path / "ckpt"))


def check_load_errors(path: str) -> None:
    model, optim = new_run(seed=0)
    save_checkpoint(path, model)
    with pytest.raises(ValueError, match=r"holds no optimizer state"):
        load_checkpoint(path, model, optim)
    other = MLP()
    per_block(other, fully_shard)
    with pytest.raises(ValueError, match=r"does not match the model: missing keys \['layers\.0"
                       r"\.weight', .*unexpected keys \['pos_emb', .*another model"):
        load_checkpoint(path, other)
    wider = Transformer(dim=16)
    per_block(wider, fully_shard)
    with pytest.raises(ValueError, match=r"shape mismatches \[\"'pos_emb': checkpoint \(6, 12\), "
                       r"model \(6, 16\)\""):
        load_checkpoint(path, wider)
    with pytest.raises(FileNotFoundError, match=r"is not a complete checkpoint"):
        load_checkpoint(path + "-missing", model)


def test_load_errors_name_keys_and_shapes(ranks, tmp_path):
    ranks.run(check_load_errors, world_size=2, path=str(tmp_path / "ckpt"))


def check_save_full_state_dict_to_one_file(path: str) -> None:
    model = sharded_transformer(0, tie_weights=True)
    save_full_state_dict(model, path)
    whole = {fqn: full(p) for fqn, p in model.named_parameters(remove_duplicate=False)}
    if dist.get_rank() == 0:
        exported = load_file(path)
        assert sorted(exported) == sorted(whole)  # tied weights under both names
        for key, value in exported.items():
            assert torch.equal(value, whole[key]), key
    else:
        assert not os.path.exists(path + ".incomplete")


def test_save_full_state_dict_to_one_file(ranks, tmp_path):
    path = str(tmp_path / "model.safetensors")
    ranks.run(check_save_full_state_dict_to_one_file, world_size=2, path=path)
