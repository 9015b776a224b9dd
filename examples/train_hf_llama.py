"""Train a Hugging Face Llama (a tiny config, no downloads) with fsdp_compose: one unit per
decoder layer by wrap policy, activation checkpointing on every layer.

    torchrun --nproc_per_node=2 examples/train_hf_llama.py                    # CPU, gloo
    torchrun --nproc_per_node=2 examples/train_hf_llama.py --export out/      # then:
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('out')"

Needs `pip install -c constraints.txt -e ".[hf]"`. The data is synthetic and learnable
(sequences count upward from a random token). Rank 0 prints the loss of every step;
`--export DIR` writes the trained weights and config as a Hugging Face checkpoint directory.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsdp_compose import WrapPolicy, checkpoint_blocks, save_full_state_dict, wrap


def counting_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(vocab, (batch, 1), generator=generator)
    return (start + torch.arange(seq)) % vocab


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank = dist.get_rank()
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)  # every rank starts from the same weights
    model = LlamaForCausalLM(config)
    checkpoint_blocks(model, LlamaDecoderLayer)  # recompute activations in backward
    wrap(model, WrapPolicy(module_classes=(LlamaDecoderLayer,)))  # a unit per layer, then the root
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for step in range(args.steps):
        data = torch.Generator().manual_seed(step * dist.get_world_size() + rank)
        tokens = counting_batch(args.batch, args.seq, args.vocab, data).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss  # the model shifts the labels
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if args.export:
        # Streamed a tensor at a time from rank 0 (several files past --max-shard-size).
        save_full_state_dict(model, args.export, max_shard_size=args.max_shard_size)
        if rank == 0:
            config.save_pretrained(args.export)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--export", help="directory for a Hugging Face checkpoint of the result")
    parser.add_argument("--max-shard-size", type=int, default=5 * 1024**3,
                        help="bytes per safetensors file of --export")
    args = parser.parse_args()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if args.export:
        os.makedirs(args.export, exist_ok=True)
    train(args, device)
    gc.collect()  # see train_gpt.py: the mesh must go before the process group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
