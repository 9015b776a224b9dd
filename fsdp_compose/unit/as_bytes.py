"""A part's gather as bytes, when its parameters cannot travel as one dtype: some gather
through an all-gather extension (torch's hooks, or a codec: param/extension.py), or they
compute in different dtypes."""

from __future__ import annotations

import torch
from torch import Tensor

from ..param.sharded_param import ShardedParam


def encode_shards(params: list[ShardedParam], device: torch.device) -> tuple[Tensor, list[int]]:
    """What a rank sends and each parameter's share: what its extension sends, or its shard
    in its dtype, as bytes padded to 8 (to be viewed in any dtype again)."""
    pieces = []
    for p in params:
        if p.extension is not None:  # the hooks choose: see param/extension.py
            local = p.local if p.local.device == device else p.local.to(device, non_blocking=True)
            pieces.append(p.extension.encode(local))
            continue
        data = p.padded_shard.to(device, p.param_dtype, non_blocking=True).view(torch.uint8)
        pieces.append(torch.nn.functional.pad(data, (0, -data.numel() % 8)))
    return torch.cat(pieces), [piece.numel() for piece in pieces]


def decode_rows(
    gathered: torch.Tensor, sizes: list[int], params: list[ShardedParam], outs: list[torch.Tensor],
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
        values = data[:, : p.layout.padded_shard_numel * out.element_size()].view(out.dtype)
        out.copy_(values.view(out.shape))
    return built
