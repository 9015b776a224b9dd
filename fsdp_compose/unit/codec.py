"""All-gather codecs: what a parameter's shard is sent as, and how the unsharded parameter is
rebuilt from what every rank sent (the float8 / NF4 all-gather pattern)."""

from __future__ import annotations

from typing import Protocol

import torch

from ..param.sharded_param import ShardedParam


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


def encode_shards(
    params: list[ShardedParam], codecs: dict[ShardedParam, AllGatherCodec], device: torch.device,
) -> tuple[torch.Tensor, list[int]]:
    """What a rank sends with codecs, all-gather hooks or mixed dtypes, and each parameter's
    share: its encoding (or shard), padded to 8 bytes to be viewed in any dtype again."""
    pieces = []
    for p in params:
        if p.extension is not None:  # the hooks choose: see param/extension.py
            local = p.local if p.local.device == device else p.local.to(device, non_blocking=True)
            pieces.append(p.extension.encode(local))
            continue
        shard = p.padded_shard.to(device, non_blocking=True)
        if (codec := codecs.get(p)) is None:
            data = shard.to(p.param_dtype)
        else:
            data = codec.encode(shard, p.layout.padded_rows, p.layout.row_numel)
        data = data.reshape(-1).view(torch.uint8)
        pieces.append(torch.nn.functional.pad(data, (0, -data.numel() % 8)))
    return torch.cat(pieces), [piece.numel() for piece in pieces]


def decode_rows(
    gathered: torch.Tensor, sizes: list[int], params: list[ShardedParam],
    codecs: dict[ShardedParam, AllGatherCodec], outs: list[torch.Tensor],
) -> bool:
    """Write each parameter's unsharded data into `outs` from the gathered bytes (row r: rank
    r's encode_shards); whether all-gather hooks built a new unsharded parameter (at first)."""
    built = False
    for out, p, data in zip(outs, params, torch.split(gathered, sizes, dim=1)):
        if p.extension is not None:
            new = p.extension.decode(data, p.local, p.param_dtype, p.sharded.requires_grad)
            if new is not None:
                p.unsharded, built = new, True
            continue
        if (codec := codecs.get(p)) is None:  # the bytes are the shards in the parameter's dtype: one copy
            values = data[:, : p.layout.padded_shard_numel * out.element_size()].view(out.dtype)
            out.copy_(values.view(out.shape))
            continue
        # A codec decodes into (ranks, padded shard numel) rows: a target sharded on another
        # dim than 0 (strided, more than 2-D) takes them afterwards.
        rows = out if out.dim() == 2 else out.new_empty(out.shape[0], p.layout.padded_shard_numel)
        codec.decode(data, rows, p.layout.padded_rows, p.layout.row_numel)
        if rows is not out:
            out.copy_(rows.view(out.shape))
    return built
