"""Training parity: fsdp_compose against single-process training and torch's fully_shard."""

from __future__ import annotations

import pytest

from tests.dist.parity import train_and_compare
from tests.models import MLP, Transformer, feature_batch, lm_loss, mse_loss, token_batch


def check_mlp_parity() -> list[tuple[bool, tuple[float, float]]]:
    return [
        (reshard, tuple(train_and_compare(MLP, mse_loss, feature_batch, steps=4,
                                          reshard_after_forward=reshard)))
        for reshard in (True, False)
    ]


def check_transformer_parity() -> list[tuple[bool, tuple[float, float]]]:
    return [
        (reshard, tuple(train_and_compare(Transformer, lm_loss, token_batch, steps=3,
                                          reshard_after_forward=reshard)))
        for reshard in (True, False)
    ]


# Ours and torch's run the same float32 math in the same order (same padding, same AVG
# reduce-scatter, AdamW on the same shards), so they agree bit for bit. The single-process
# reference sums the batch in another order; train_and_compare holds it to assert_close.
TORCH_TOLERANCE = 0.0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mlp_trains_like_single_process_and_torch(ranks, world_size):
    for errors in ranks.run(check_mlp_parity, world_size=world_size):
        for reshard, (_, vs_torch) in errors:
            assert vs_torch <= TORCH_TOLERANCE, (reshard, vs_torch)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transformer_trains_like_single_process_and_torch(ranks, world_size):
    for errors in ranks.run(check_transformer_parity, world_size=world_size):
        for reshard, (_, vs_torch) in errors:
            assert vs_torch <= TORCH_TOLERANCE, (reshard, vs_torch)
