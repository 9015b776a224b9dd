"""Models of the benchmarks beside the GPT of examples/train_gpt.py: GPT-2's pre-norm
transformer block (a unit of 12 parameters) for overhead.py and optimizer.py, and a Llama-style
decoder for step.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A pre-norm transformer block with GPT-2's 12 parameters (dim divisible by heads)."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.qkv = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim)
        self.proj, self.mlp_norm = nn.Linear(dim, dim), nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, seq, head_dim)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class LlamaBlock(nn.Module):
    """Bias-free attention and a SwiGLU MLP, RMSNorm before each. No rotary embeddings: the
    counting data needs no positions, and a step's cost is in the matrix multiplies."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        hidden = -(-8 * dim // (3 * 64)) * 64  # Llama's: 8/3 of dim, up to a multiple of 64
        self.heads, self.attn_norm = heads, nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(dim)
        self.w1, self.w2, self.w3 = (nn.Linear(a, b, bias=False) for a, b in
                                     ((dim, hidden), (hidden, dim), (dim, hidden)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (batch, seq, dim), h = x.shape, self.attn_norm(x)
        q, k, v = (w(h).view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(out.transpose(1, 2).reshape(batch, seq, dim))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Built and trained as the GPT is, one unit per block; `seq` is unused (no position
    embedding)."""

    def __init__(self, vocab: int, dim: int, heads: int, depth: int, seq: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"Llama(dim={dim}, heads={heads}): dim must be a multiple of heads")
        self.tok_emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads) for _ in range(depth))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))
