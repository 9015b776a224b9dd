"""Initialisation: meta-device models materialised module by module with the values of the
non-sharded model, the to_empty flow of torch's fully_shard, and sync from the first rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_compose import fully_shard, materialize
from tests.dist.parity import full, make_mesh, per_block
from tests.dist.training import train_step_matches
from tests.models import MLP, Transformer


def gpt_init(module: nn.Module) -> None:
    """A GPT-2 style init of each module's own parameters."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    if isinstance(module, Transformer):
        nn.init.normal_(module.pos_emb, std=0.01)


def assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    ref_params = dict(ref.named_parameters())
    assert [fqn for fqn, _ in model.named_parameters()] == list(ref_params)
    for fqn, p in model.named_parameters():
        assert not p.is_meta, fqn
        assert torch.equal(full(p), ref_params[fqn]), fqn


def check_meta_init_matches_seeded_model() -> None:
    # Default init: each Linear's reset_parameters, as when the model is built on CPU.
    torch.manual_seed(0)
    ref = MLP()
    with torch.device("meta"):
        model = MLP()
    per_block(model, fully_shard)
    torch.manual_seed(0)
    materialize(model)
    assert_same_params(model, ref)

    # A custom init with tied weights across the root unit: the values of model.apply().
    torch.manual_seed(1)
    ref = Transformer(tie_weights=True)
    torch.manual_seed(0)
    ref.apply(gpt_init)
    with torch.device("meta"):
        model = Transformer(tie_weights=True)
    per_block(model, fully_shard)
    before = list(model.parameters())  # e.g. an optimizer built before materialize
    torch.manual_seed(0)
    materialize(model, init_fn=gpt_init)
    assert all(p is q for p, q in zip(model.parameters(), before))  # the same objects
    assert model.head.weight is model.tok_emb.weight
    assert_same_params(model, ref)
    train_step_matches(model, ref)


def test_meta_init_matches_seeded_model(ranks):
    ranks.run(check_meta_init_matches_seeded_model, world_size=2)


def check_meta_init_peak_is_one_module() -> int:
    dim, layers = 64, 8
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    tracker = MemTracker()
    with tracker:
        materialize(model)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    module_bytes = (dim * dim + dim) * 4
    shard_bytes = layers * module_bytes // dist.get_world_size()
    # The shards, one module whole, and its unsharded buffer while it is being sized (a
    # moment before its storage is freed); the whole model would be 8 modules.
    assert peak <= shard_bytes + 2 * module_bytes, (peak, shard_bytes, module_bytes)
    return peak


def test_meta_init_peak_is_one_module(ranks):
    ranks.run(check_meta_init_peak_is_one_module, world_size=2)


def check_materialize_errors() -> None:
    with pytest.raises(TypeError, match=r"materialize\(MLP\): the module is not annotated"):
        materialize(MLP())
    with torch.device("meta"):
        model = Transformer()
    per_block(model, fully_shard)
    with pytest.raises(ValueError, match=r"FSDPTransformer at '<root>' has parameters or "
                       r"buffers on the meta device but no reset_parameters\(\); pass init_fn"):
        materialize(model)
    assert all(p.is_meta for p in model.parameters())  # nothing changed


def test_materialize_errors(ranks):
    ranks.run(check_materialize_errors, world_size=2)


def check_to_empty_then_init_like_torch() -> None:
    """torch's flow: to_empty() swaps the sharded parameters' data; the next forward
    adopts what the user wrote into them."""
    mesh = make_mesh()
    torch.manual_seed(0)
    ref = Transformer()
    with torch.device("meta"):
        model = Transformer()
    per_block(model, fully_shard)
    model.to_empty(device="cpu")
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            p.copy_(distribute_tensor(ref_params[fqn].detach(), mesh, [Shard(0)]))
    train_step_matches(model, ref)


def test_to_empty_then_init_like_torch(ranks):
    ranks.run(check_to_empty_then_init_like_torch, world_size=2)


def check_sync_module_states(mesh_shape: tuple[int, ...]) -> None:
    mesh = make_mesh(mesh_shape)
    torch.manual_seed(0)
    first = MLP()
    first.layers[1].register_buffer("scale", torch.randn(5))
    rank = dist.get_rank()
    torch.manual_seed(100 * rank)  # every rank differs; rank 0 builds `first`
    model = MLP()
    model.layers[1].register_buffer("scale", torch.randn(5))
    assert rank == 0 or not torch.equal(model.layers[1].scale, first.layers[1].scale)
    per_block(model, lambda m, **kw: fully_shard(m, mesh=mesh, sync_module_states=True))
    assert_same_params(model, first)
    assert torch.equal(model.layers[1].scale, first.layers[1].scale)


def test_sync_module_states(ranks):
    ranks.run(check_sync_module_states, world_size=2, mesh_shape=(2,))
    ranks.run(check_sync_module_states, world_size=4, mesh_shape=(2, 2))
