"""A data-parallel group of one rank gathers and reduces nothing: its shards are the whole
parameters, so the unsharded parameters are views of them (no all-gather, no copy), and
each gradient is its own reduced shard (no reduce-scatter, no copy: the sharded `.grad`s
are views of autograd's gradients). It trains as torch's fully_shard and the
single-process model do."""

from __future__ import annotations

import torch

from fsdp_compose import fully_shard
from tests.dist.counting import ALL_GATHER, REDUCE_SCATTER, OpCounter
from tests.dist.parity import per_block, train_and_compare
from tests.models import Transformer, lm_loss, token_batch

COPIES = ("aten::copy_", "aten::split_with_sizes_copy", "aten::_to_copy", "aten::cat",
          "aten::_chunk_cat", "aten::clone")


def check_one_rank() -> dict[str, object]:
    errors = train_and_compare(Transformer, lm_loss, token_batch)
    torch.manual_seed(0)
    model = Transformer()
    per_block(model, fully_shard)
    shards = {name: p.to_local().untyped_storage().data_ptr() for name, p in model.named_parameters()}
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


def test_one_rank_gathers_and_copies_nothing(ranks):
    result = ranks.run(check_one_rank, world_size=1)[0]
    vs_reference, vs_torch = result["errors"]
    assert vs_torch == 0.0 and vs_reference < 1e-6
    assert result["seen"] and all(result["seen"].values()), result["seen"]
    for counts in (result["forward"], result["backward"]):
        assert counts[ALL_GATHER] == 0 and counts[REDUCE_SCATTER] == 0
    for ours, plain in (("forward", "plain_forward"), ("backward", "plain_backward")):
        copies = [{op: n for op, n in result[k].items() if op in COPIES} for k in (ours, plain)]
        assert copies[0] == copies[1], (ours, *copies)  # the plain model's own, nothing more
    assert result["grads_apart"]
