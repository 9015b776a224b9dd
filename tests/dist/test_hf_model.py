"""A model nobody here wrote: a Hugging Face Llama causal LM from a tiny config, one unit
per decoder layer by wrap policy, activation checkpointing on, trained in parity with
single-process training and with torch's fully_shard."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.fsdp import is_fsdp_managed_module
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsdp_compose import WrapPolicy, checkpoint_blocks, wrap
from tests.dist.parity import (
    assert_close_to,
    backward,
    make_mesh,
    max_diff,
    max_diff_to,
    optimizer_step,
)
from tests.models import token_batch

CONFIG = LlamaConfig(
    vocab_size=31, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    tie_word_embeddings=False,
)


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def check_hf_llama_parity(steps: int) -> float:
    mesh = make_mesh()
    torch.manual_seed(0)
    ref = LlamaForCausalLM(CONFIG)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    checkpoint_blocks(ours, LlamaDecoderLayer)
    wrap(ours, WrapPolicy(module_classes=(LlamaDecoderLayer,)), mesh=mesh)
    checkpoint_blocks(theirs, LlamaDecoderLayer)
    for layer in theirs.model.layers:
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    models = (ref, ours, theirs)
    # SGD: Adam's first step moves every weight by about lr whatever its gradient's size,
    # so float noise in a near-zero gradient of the reference would look like an error.
    optims = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    vs_torch = 0.0
    for step in range(steps):
        tokens = token_batch(step, 2 * dist.get_world_size(), seq=8)
        _, our_loss, their_loss = backward(models, tokens, hf_loss)
        vs_torch = max(vs_torch, max_diff(our_loss, their_loss))
        optimizer_step(optims)
        assert_close_to(ours, ref, where=step)
        vs_torch = max(vs_torch, max_diff_to(ours, theirs))
    return vs_torch


def test_hf_llama_trains_like_single_process_and_torch(ranks):
    assert ranks.run(check_hf_llama_parity, world_size=2, steps=3) == [0.0, 0.0]


def check_generate_with_uneven_stopping() -> int:
    """generate() on every rank, each stopping at another length: transformers keeps the
    ranks that finished running forward (synced_gpus) because it sees the model is
    FSDP-managed, so every rank's all-gathers still pair up."""
    torch.manual_seed(0)
    ref = LlamaForCausalLM(CONFIG).eval()
    ours = copy.deepcopy(ref)
    wrap(ours, WrapPolicy(module_classes=(LlamaDecoderLayer,)), mesh=make_mesh())
    assert is_fsdp_managed_module(ours) and is_fsdp_managed_module(ours.model.layers[0].mlp)
    rank = dist.get_rank()
    prompt = token_batch(rank, 1, seq=4)
    settings = {"max_new_tokens": 2 + 5 * rank, "do_sample": False, "pad_token_id": 0}
    expected = ref.generate(prompt, **settings)
    generated = ours.generate(prompt, **settings)
    assert torch.equal(generated, expected), (generated, expected)
    return generated.shape[1]


def test_generate_with_ranks_stopping_at_different_steps(ranks):
    assert ranks.run(check_generate_with_uneven_stopping, world_size=2, timeout=120) == [7, 12]
