"""A Llama-style decoder for benchmarks/step.py: RMSNorm, bias-free attention through
scaled_dot_product_attention, and a SwiGLU MLP, with blocks in `blocks` as the GPT of
examples/train_gpt.py has them (one unit per block). No rotary embeddings: the counting
data needs no positions, and the step's cost is in the matrix multiplies."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_hidden(dim: int) -> int:
    """Llama's MLP width: 8/3 of `dim`, rounded up to a multiple of 64."""
    return -(-8 * dim // (3 * 64)) * 64


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape

        def split_heads(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, seq, head_dim)
            return t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)

        q, k, v = (split_heads(w(x)) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = swiglu_hidden(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = SwiGLU(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Takes what the GPT takes (`seq` is unused: no position embedding), so that the two
    are built and trained alike."""

    def __init__(self, vocab: int, dim: int, heads: int, depth: int, seq: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"Llama(dim={dim}, heads={heads}): dim must be a multiple of heads")
        self.tok_emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))
