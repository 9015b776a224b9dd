"""All-gather codecs: what a parameter's shard is sent as, and how the unsharded parameter is
rebuilt from what every rank sent (the float8 / NF4 all-gather pattern). A codec is a short
way to write torch's all-gather extension (param/extension.py), and runs as one."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from .sharded_param import ShardedParam


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

    def decode(self, encoded: Tensor, out: Tensor, rows: int, row_numel: int) -> None: ...


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
        scales = encoded[:, rows * row_numel : rows * row_numel + 4 * rows]
        scale = scales.contiguous().view(torch.float32).view(ranks, rows, 1)
        out.view(ranks, rows, row_numel).copy_(quantized.float() * scale)


class CodecHooks:
    """`codec` on one parameter as torch's all-gather hooks: the pre hook encodes the padded
    shard, the post hook decodes every rank's into unsharded data of its own (freed on reshard)."""

    def __init__(self, codec: AllGatherCodec, param: ShardedParam, device: torch.device) -> None:
        self.codec, self._param, self._device = codec, param, device
        self._flat: torch.Tensor | None = None  # the unsharded data, padded rows

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor], None]:
        layout = self._param.layout
        shard = self._param.padded_shard.to(self._device, non_blocking=True)
        return (self.codec.encode(shard, layout.padded_rows, layout.row_numel),), None

    def fsdp_post_all_gather(
        self, outputs: list[torch.Tensor], metadata: None, param_dtype: torch.dtype, *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor]] | None:
        layout = self._param.layout
        ranks = layout.shard_size
        if out is None or self._flat is None:
            self._flat = outputs[0].new_empty(ranks * layout.padded_shard_numel, dtype=param_dtype)
        # Written through .data: Note [version counter] in sharded_param.py. Rows of a
        # parameter sharded on another dim than 0 land strided: decoded apart first.
        target = layout.rank_rows(self._flat.data)
        rows = target if target.dim() == 2 else target.new_empty(ranks, layout.padded_shard_numel)
        encoded = outputs[0].view(ranks, -1).view(torch.uint8)
        self.codec.decode(encoded, rows, layout.padded_rows, layout.row_numel)
        if rows is not target:
            target.copy_(rows.view(target.shape))
        if out is not None:
            return None
        return self._flat[: layout.numel].view(layout.shape), (self._flat,)
