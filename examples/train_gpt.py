"""Train a small GPT with fsdp_compose, one unit per transformer block plus the root.

    torchrun --nproc_per_node=2 examples/train_gpt.py                 # CPU, gloo
    torchrun --nproc_per_node=8 examples/train_gpt.py --dim 1024 --depth 24   # GPUs, NCCL

    # Checkpoint every 5 steps and resume from the last one after a failure (the variable
    # works around pytorch/pytorch#135712, stale peer addresses after a restart):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \
        examples/train_gpt.py --checkpoint ckpt

    # Trace the last step: a table per unit, trace/step.json (Perfetto), trace/step.png:
    torchrun --nproc_per_node=2 examples/train_gpt.py --trace trace

The data is synthetic and learnable (each sequence counts upward from a random token), so
the loss falls within a few steps. Each step's batches depend only on the step and rank, so
a resumed run trains exactly as an uninterrupted one. Rank 0 prints the loss of every step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_compose import (
    StepTrace,
    fully_shard,
    load_checkpoint,
    save_checkpoint,
    save_full_state_dict,
)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, depth: int, seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        causal_mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), 1)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x, causal_mask)
        return self.head(self.norm(x))


def counting_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(vocab, (batch, 1), generator=generator)
    return (start + torch.arange(seq + 1)) % vocab


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)  # every rank starts from the same weights
    model = GPT(args.vocab, args.dim, args.heads, args.depth, args.seq)
    for block in model.blocks:
        fully_shard(block)  # one unit per block: gathered just before it runs
    fully_shard(model)  # the root unit: embeddings, final norm and head
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # steps on the shards

    first_step = 0
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, ".metadata")):
        first_step = load_checkpoint(args.checkpoint, model, optimizer)  # any world size
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {first_step}", flush=True)
    for step in range(first_step, args.steps):
        seed = step * dist.get_world_size() + rank  # one per step and rank
        data = torch.Generator().manual_seed(seed)
        tokens = counting_batch(args.batch, args.seq, args.vocab, data).to(device)
        tracing = args.trace and step == args.steps - 1  # the last step, warmed up
        with StepTrace(model) if tracing else contextlib.nullcontext() as trace:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if trace is not None:
            save_trace(trace, args.trace)
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
        if args.checkpoint and (step + 1) % args.save_every == 0:
            save_checkpoint(args.checkpoint, model, optimizer, step=step + 1)  # atomic
    if args.export:
        save_full_state_dict(model, args.export)  # the whole weights, a tensor at a time


def save_trace(trace: StepTrace, directory: str) -> None:
    """The traced step: a table (rank 0 prints it), step.json for Perfetto (every rank's),
    step.png (rank 0's timeline; needs matplotlib)."""
    os.makedirs(directory, exist_ok=True)
    trace.save_chrome(os.path.join(directory, "step.json"))
    if dist.get_rank() == 0:
        print(trace.table(), flush=True)
        try:
            trace.save_png(os.path.join(directory, "step.png"))
        except ImportError:
            print("(no step.png: pip install matplotlib)")


def init_distributed() -> torch.device:
    """Join the process group torchrun describes: NCCL on this rank's GPU, else gloo on CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", help="directory to save to, and resume from if present")
    parser.add_argument("--save-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--export", help="write the trained weights to this .safetensors file")
    parser.add_argument("--trace", help="trace the last step into this directory (StepTrace)")
    args = parser.parse_args()
    train(args, init_distributed())
    # Collect the model, and the DeviceMesh it holds, while the process group is still up:
    # a mesh that lives on into interpreter shutdown can make gloo abort the process.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
