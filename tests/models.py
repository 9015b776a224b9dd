"""Small models for the tests, with odd sizes so uneven and empty shards get exercised."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear layers 8 -> 7 -> 5 -> 3 -> 1: dim 0 of 7, 5, 3 and 1 never divides 2 or 4."""

    def __init__(self, dims: tuple[int, ...] = (8, 7, 5, 3, 1)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        # No qkv bias: the key bias has an exactly zero gradient (softmax ignores a shift),
        # so its float noise would dominate Adam's update and hide real differences.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    """A tiny GPT: token and position embeddings, blocks, a final norm and an LM head."""

    def __init__(self, vocab: int = 31, dim: int = 12, heads: int = 2, depth: int = 2,
                 seq: int = 6, tie_weights: bool = False) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# A stack of Linear(33, 33): 33 rows pad the shards at every world size the tests use.
LINEAR_DIM, LINEAR_LAYERS = 33, 6


def linear_stack() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(LINEAR_DIM, LINEAR_DIM) for _ in range(LINEAR_LAYERS)))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on `tokens` (batch, seq + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def mse_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Squared error of the output against the first feature of `x` (batch, ..., features),
    in `x`'s dtype: a bf16 or fp16 output (mixed precision) is compared in float32."""
    return (model(x).to(x.dtype) - x[..., :1]).pow(2).mean()


def token_batch(step: int, batch: int, seq: int = 6, vocab: int = 31) -> torch.Tensor:
    """The same tokens on every rank for a given step."""
    return torch.randint(vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(step))


def feature_batch(step: int, batch: int, dim: int = 8) -> torch.Tensor:
    return torch.randn(batch, dim, generator=torch.Generator().manual_seed(step))
