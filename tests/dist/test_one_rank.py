"""A data-parallel group of one rank gathers nothing: its shards are the whole parameters,
so the unsharded parameters are views of them (no all-gather, no copy). Its reduction sends
nothing and copies as torch's does: the gradients chunked into one buffer, copied out as
the reduced shards (a `.grad` never aliases autograd's gradient). Under a mixed-precision
policy the shards are cast straight into the unsharded parameters (one foreach copy per
gather, nothing copied out).
It trains as torch's fully_shard and the single-process model do."""

from __future__ import annotations

from collections import Counter

import torch

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from tests.dist.counting import ALL_GATHER, REDUCE_SCATTER, OpCounter
from tests.dist.parity import per_block, train_and_compare
from tests.models import Transformer, lm_loss, token_batch

COPIES = ("aten::copy_", "aten::split_with_sizes_copy", "aten::_to_copy", "aten::cat",
          "aten::_chunk_cat", "aten::clone", "aten::_foreach_copy_")


def check_one_rank() -> dict[str, object]:
    errors = train_and_compare(Transformer, lm_loss, token_batch)
    torch.manual_seed(0)
    model = Transformer()
    per_block(model, fully_shard)
    shards = {
        name: p.to_local().untyped_storage().data_ptr() for name, p in model.named_parameters()
    }
    seen: dict[str, bool] = {}

    def views_of_shards(module, args) -> None:
        for name, p in module.named_parameters(prefix=module_names[module]):
            seen[name] = p.untyped_storage().data_ptr() == shards[name]

    module_names = {block: f"blocks.{i}" for i, block in enumerate(model.blocks)}
    for block in model.blocks:
        block.register_forward_pre_hook(views_of_shards)  # after fully_shard's: unsharded
    lm_loss(model, token_batch(0, 2)).backward()  # the first step: one-time checks
    with OpCounter() as ops:
        loss = lm_loss(model, token_batch(1, 2))
    forward = ops.counts
    with OpCounter() as ops:
        loss.backward()
    backward = ops.counts
    grads_on_autograds = all(
        p.grad.to_local().untyped_storage().data_ptr() != shards[name]
        for name, p in model.named_parameters()
    )
    torch.manual_seed(0)
    plain = Transformer()
    with OpCounter() as plain_forward:
        loss = lm_loss(plain, token_batch(1, 2))
    with OpCounter() as plain_backward:
        loss.backward()
    return {"errors": tuple(errors), "seen": seen, "forward": forward, "backward": backward,
            "plain_forward": plain_forward.counts, "plain_backward": plain_backward.counts,
            "grads_apart": grads_on_autograds}


def test_one_rank_gathers_nothing_and_reduces_with_torchs_copies(ranks):
    result = ranks.run(check_one_rank, world_size=1)[0]
    vs_reference, vs_torch = result["errors"]
    assert vs_torch == 0.0 and vs_reference < 1e-6
    assert result["seen"] and all(result["seen"].values()), result["seen"]
    for counts in (result["forward"], result["backward"]):
        assert counts[ALL_GATHER] == 0 and counts[REDUCE_SCATTER] == 0
    units = 3  # two blocks and the root: one reduction each
    for ours, plain, beyond in (("forward", "plain_forward", {}),
                                ("backward", "plain_backward",
                                 {"aten::_chunk_cat": units, "aten::copy_": units})):
        copies = [{op: n for op, n in result[k].items() if op in COPIES} for k in (ours, plain)]
        expected = dict(Counter(copies[1]) + Counter(beyond))
        assert copies[0] == expected, (ours, *copies)  # the plain model's own, and the reduction's
    assert result["grads_apart"]


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
CAST = COPIES[-1]


class CastCounter(OpCounter):
    """Every op by name (OpCounter), and what the foreach copies wrote: per (source dtype,
    destination dtype), the tensors and their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter = Counter()
        self.cast_bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == CAST:
            for dst, src in zip(args[0], args[1]):
                self.casts[src.dtype, dst.dtype] += 1
                self.cast_bytes[src.dtype, dst.dtype] += dst.numel() * dst.element_size()
        return super().__torch_dispatch__(func, types, args, kwargs)


def counted(mode: CastCounter) -> dict[str, object]:
    return {"copies": {op: n for op, n in mode.counts.items() if op in COPIES},
            "collectives": mode.counts[ALL_GATHER] + mode.counts[REDUCE_SCATTER],
            "casts": dict(mode.casts), "cast_bytes": dict(mode.cast_bytes)}


def check_one_rank_bf16() -> dict[str, object]:
    errors = train_and_compare(Transformer, lm_loss, token_batch, mp_policy=BF16,
                               reference_tolerance={"rtol": 5e-2, "atol": 5e-2})
    torch.manual_seed(0)
    model = Transformer()
    per_block(model, fully_shard, mp_policy=BF16)
    lm_loss(model, token_batch(0, 2)).backward()  # the first step: one-time checks
    with CastCounter() as forward:
        loss = lm_loss(model, token_batch(1, 2))
    with CastCounter() as backward:
        loss.backward()
    torch.manual_seed(0)
    plain = Transformer().to(torch.bfloat16)  # computes as the policy has ours compute
    with CastCounter() as plain_forward:
        lm_loss(plain, token_batch(1, 2))

    def bf16_bytes(params) -> int:
        return sum(p.numel() * 2 for p in params)

    return {"errors": tuple(errors), "forward": counted(forward), "backward": counted(backward),
            "plain_forward": counted(plain_forward),
            "params": len(list(model.parameters())), "bytes": bf16_bytes(model.parameters()),
            "block_params": len(list(model.blocks.parameters())),
            "block_bytes": bf16_bytes(model.blocks.parameters())}


def test_one_rank_bf16_casts_each_shard_into_its_parameter_and_copies_nothing_out(ranks):
    result = ranks.run(check_one_rank_bf16, world_size=1)[0]
    assert result["errors"][1] == 0.0, result["errors"]  # bit for bit torch's fully_shard
    forward, backward = result["forward"], result["backward"]
    assert forward["collectives"] == backward["collectives"] == 0
    # Forward: the plain bf16 model's own copies and the casts, one per parameter (every
    # unit gathers once: one foreach copy each), nothing copied out.
    fp32_to_bf16 = (torch.float32, torch.bfloat16)
    units = 1 + 2  # the root, two blocks
    assert forward["copies"] == {**result["plain_forward"]["copies"], CAST: units}, forward
    assert forward["casts"] == {fp32_to_bf16: result["params"]}, forward
    assert forward["cast_bytes"] == {fp32_to_bf16: result["bytes"]}, forward
    # Backward: the blocks gather again (the root stays unsharded); no copy-out either.
    assert "aten::split_with_sizes_copy" not in backward["copies"], backward
    assert backward["copies"][CAST] == 2, backward
    assert backward["casts"] == {fp32_to_bf16: result["block_params"]}, backward
    assert backward["cast_bytes"] == {fp32_to_bf16: result["block_bytes"]}, backward
