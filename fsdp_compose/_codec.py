"""All-gather codecs: what a parameter's shard is sent as, and how the unsharded parameter is
rebuilt from what every rank sent (the float8 / NF4 all-gather pattern)."""

from __future__ import annotations

from typing import Protocol

import torch


class AllGatherCodec(Protocol):
    """Set on a unit's parameters with `FSDPModule.set_all_gather_codec`.

    `encode(shard)`: this rank's padded shard (flat, in the parameter's dtype, `rows` rows
    of `row_numel` elements) as a flat tensor of any dtype; every rank's encoding of a
    parameter has the same number of bytes. `decode(encoded, out)`: `encoded` is
    (ranks, encoded bytes) as uint8, row r from rank r; write the unsharded rows into `out`,
    (ranks, rows * row_numel) in the dtype the unit computes in. Gradients flow to the
    decoded parameter and are reduced as usual, into the full-precision shards.
    """

    def encode(self, shard: torch.Tensor, rows: int, row_numel: int) -> torch.Tensor: ...

    def decode(self, encoded: torch.Tensor, out: torch.Tensor, rows: int, row_numel: int) -> None: ...


class Int8RowCodec:
    """Send each row as int8 with a float32 scale (symmetric, per row absmax): about a
    quarter of a float32 all-gather. The weights stay float32 in the shards and the
    optimizer; forward and backward see them rounded to 8 bits per row."""

    def encode(self, shard: torch.Tensor, rows: int, row_numel: int) -> torch.Tensor:
        values = shard.view(rows, row_numel).float()
        scale = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        quantized = torch.round(values / scale).to(torch.int8)
        return torch.cat([quantized.view(-1), scale.view(-1).view(torch.int8)])

    def decode(self, encoded: torch.Tensor, out: torch.Tensor, rows: int, row_numel: int) -> None:
        ranks = encoded.shape[0]
        quantized = encoded[:, : rows * row_numel].view(torch.int8).view(ranks, rows, row_numel)
        scales = encoded[:, rows * row_numel : rows * row_numel + 4 * rows]  # then padding
        scale = scales.contiguous().view(torch.float32).view(ranks, rows, 1)
        out.view(ranks, rows, row_numel).copy_(quantized.float() * scale)
