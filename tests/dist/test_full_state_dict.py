"""save_full_state_dict / load_full_state_dict: whole checkpoints in Hugging Face's
safetensors layout, streamed a tensor at a time. What is written equals the unsharded
model's state dict (read back by the safetensors package and by transformers'
from_pretrained), several files get an index, loading reshards into any world size and
placement, and a checkpoint that does not fit the model is refused on every rank."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import Shard
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_compose import fully_shard, load_full_state_dict, save_full_state_dict
from tests.dist.parity import full, make_mesh, per_block
from tests.models import Transformer, lm_loss, token_batch

LLAMA = LlamaConfig(
    vocab_size=31, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
)


def sharded(model: torch.nn.Module, **kwargs: object) -> torch.nn.Module:
    per_block(model, fully_shard, mesh=make_mesh(), **kwargs)
    return model


def whole_lists(model: torch.nn.Module) -> dict[str, list]:
    """Every state-dict entry, whole, as lists (to travel through the result queue)."""
    return {k: full(v).tolist() for k, v in model.state_dict().items()}


def check_save(path: str, max_shard_size: int) -> dict[str, list]:
    torch.manual_seed(0)
    ref = Transformer(tie_weights=True)
    model = sharded(copy.deepcopy(ref))
    save_full_state_dict(model, path, max_shard_size=max_shard_size)
    return {k: v.tolist() for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("max_shard_size", [5 * 1024**3, 4096], ids=["one file", "several files"])
def test_saved_is_the_whole_model(ranks, tmp_path, max_shard_size):
    expected = ranks.run(check_save, path=str(tmp_path), max_shard_size=max_shard_size)[0]
    files = sorted(p.name for p in tmp_path.iterdir())
    if max_shard_size > 1024**3:
        assert files == ["model.safetensors"]
        written = load_file(tmp_path / "model.safetensors")
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(files) > 3 and set(index["weight_map"]) == set(expected)
        assert set(index["weight_map"].values()) == set(files) - {"model.safetensors.index.json"}
        written = {}
        for name in set(index["weight_map"].values()):
            written.update(load_file(tmp_path / name))
        total = sum(t.numel() * t.element_size() for t in written.values())
        assert index["metadata"]["total_size"] == total
    assert set(written) == set(expected)
    for key, value in expected.items():
        assert torch.equal(written[key], torch.tensor(value)), key


def check_load(path: str, shard_dim: int) -> dict[str, list]:
    """Into a freshly initialised model (another seed), sharded over this world's ranks
    on `shard_dim` for matrices."""
    torch.manual_seed(1)
    model = Transformer(tie_weights=True)
    fn = (lambda p: Shard(shard_dim) if p.ndim == 2 else None) if shard_dim else None
    model = sharded(model, shard_placement_fn=fn) if dist.get_world_size() > 1 else model
    load_full_state_dict(model, path)
    lm_loss(model, token_batch(0, 2)).backward()  # it trains on
    return whole_lists(model)


def test_loads_at_any_world_size_and_placement(ranks, tmp_path):
    path = str(tmp_path / "model.safetensors")
    expected = ranks.run(check_save, path=path, max_shard_size=1024**3)[0]
    for world, dim in ((2, 0), (4, 0), (2, 1), (1, 0)):
        for loaded in ranks.run(check_load, path=path, shard_dim=dim, world_size=world):
            assert loaded == expected, (world, dim)


def check_hf_round_trip(path: str) -> list:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LLAMA)
    tokens = token_batch(0, 2, seq=8)
    expected = model(input_ids=tokens).logits
    for layer in model.model.layers:
        fully_shard(layer, mesh=make_mesh())
    fully_shard(model, mesh=make_mesh())
    save_full_state_dict(model, path)
    if dist.get_rank() == 0:
        LLAMA.save_pretrained(path)
    dist.barrier()
    loaded = LlamaForCausalLM.from_pretrained(path)  # transformers' own loader, one process
    return (loaded(input_ids=tokens).logits - expected).abs().max().tolist()


def test_transformers_loads_it(ranks, tmp_path):
    assert ranks.run(check_hf_round_trip, path=str(tmp_path)) == [0.0, 0.0]


def check_refused(path: str) -> list[str]:
    torch.manual_seed(0)
    model = sharded(Transformer(dim=16))  # other shapes, and no tied head
    with pytest.raises(ValueError) as raised:
        load_full_state_dict(model, path)
    return [str(raised.value)]


def test_mismatch_refused_on_every_rank(ranks, tmp_path):
    path = str(tmp_path / "model.safetensors")
    ranks.run(check_save, path=path, max_shard_size=1024**3)
    for (message,) in ranks.run(check_refused, path=path):
        assert "does not match the model" in message
        assert "shape mismatches" in message
        assert "'tok_emb.weight': checkpoint (31, 12), model (31, 16)" in message


class WithExtraState(torch.nn.Linear):
    def get_extra_state(self) -> dict:
        return {"step": 3}

    def set_extra_state(self, state: dict) -> None:
        pass


def check_extra_state_refused(path: str) -> str:
    model = WithExtraState(4, 4)
    fully_shard(model, mesh=make_mesh())
    with pytest.raises(ValueError) as raised:
        save_full_state_dict(model, path)
    return str(raised.value)


def test_extra_state_refused_on_every_rank(ranks, tmp_path):
    for message in ranks.run(check_extra_state_refused, path=str(tmp_path)):
        assert "['_extra_state'] are not tensors" in message
