"""Gathering in place: over gloo on the CPU, a unit whose parameters are all sharded on dim
0 in one dtype gathers each parameter straight into its own unsharded data (one coalesced
collective per unit and pass), so forward copies nothing; the unsharded parameters are
the gather's outputs; training is bit-identical to torch's fully_shard. A parameter
sharded on another dim, or a mixed-precision policy, keeps the rule's other side where it
must (one flat all-gather, copied out), with the same parity."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from tests.dist.counting import ALL_GATHER, ALL_GATHER_EACH, OpCounter
from tests.dist.parity import per_block, train_and_compare
from tests.models import Transformer, lm_loss, token_batch

COPIES = ("aten::copy_", "aten::split_with_sizes_copy", "aten::cat", "aten::_chunk_cat")


def dim1_weights(param: torch.nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim == 2 and param.shape[1] == 12 else None


SETUPS = {
    "dim0": {},
    "some on dim 1": {"shard_placement_fn": dim1_weights},
    "bf16 policy": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
}


def check_forward(setup: str) -> dict[str, object]:
    kwargs = SETUPS[setup]
    tolerance = {"rtol": 5e-2, "atol": 5e-2} if "mp_policy" in kwargs else None
    errors = train_and_compare(
        Transformer, lm_loss, token_batch, reference_tolerance=tolerance, **kwargs
    )
    torch.manual_seed(0)
    model = Transformer()
    per_block(model, fully_shard, **kwargs)
    lm_loss(model, token_batch(0, 2)).backward()  # the first step: one-time checks
    in_outputs: list[bool] = []

    def check_in_outputs(module, args) -> None:
        in_outputs.extend(p.data_ptr() in ops.gathered_into for p in module.parameters())

    for block in model.blocks:
        block.register_forward_pre_hook(check_in_outputs)  # after fully_shard's: unsharded
    with OpCounter() as ops:
        lm_loss(model, token_batch(1, 2))
    return {"errors": tuple(errors), "in_outputs": in_outputs, "forward": ops.counts}


@pytest.mark.parametrize("world_size", [2, 4])
def test_dim0_units_gather_in_place_and_copy_nothing_in_forward(ranks, world_size):
    for result in ranks.run(check_forward, world_size=world_size, setup="dim0"):
        assert result["errors"][1] == 0.0, result["errors"]
        assert result["in_outputs"] and all(result["in_outputs"])
        forward = result["forward"]
        # Two blocks and the root: one coalesced gather each, nothing flat, nothing copied.
        assert forward[ALL_GATHER_EACH] == 3 and forward[ALL_GATHER] == 0, forward
        assert not {op: n for op, n in forward.items() if op in COPIES}, forward


@pytest.mark.parametrize("setup", ["some on dim 1", "bf16 policy"])
def test_the_rule_gathers_flat_or_casts_only_where_it_must(ranks, setup):
    result = ranks.run(check_forward, world_size=2, setup=setup)[0]
    assert result["errors"][1] == 0.0, result["errors"]
    forward = result["forward"]
    if setup == "some on dim 1":  # every unit has a (*, 12) weight: copied out of rows
        assert forward[ALL_GATHER] == 3 and forward[ALL_GATHER_EACH] == 0, forward
        assert forward["aten::copy_"] > 0, forward
    else:  # cast to bf16 once per gather (its input), then in place
        assert forward[ALL_GATHER_EACH] == 3 and forward[ALL_GATHER] == 0, forward
        assert all(result["in_outputs"])
        assert forward["aten::_to_copy"] == 3, forward
