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


def shifted_torch_fully_shard(module, **kwargs) -> None:
    """torch's fully_shard, then every shard it made moved by 1e-3."""
    import torch
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch_fully_shard(module, **kwargs)
    with torch.no_grad():
        for p in module.parameters():
            p.to_local().add_(1e-3)


def check_the_helper_fails_on_a_shifted_reference() -> str:
    from fsdp_compose import fully_shard

    with pytest.raises(AssertionError, match="differs from torch's fully_shard by") as failed:
        train_and_compare(
            MLP, mse_loss, feature_batch, shard_fns=(fully_shard, shifted_torch_fully_shard)
        )
    # A run that differs from torch's on purpose says why, and gets the difference back.
    errors = train_and_compare(MLP, mse_loss, feature_batch, torch_differs="shifted by 1e-3",
                               shard_fns=(fully_shard, shifted_torch_fully_shard))
    assert errors.vs_torch >= 1e-3 / 2, errors
    return str(failed.value)


@pytest.mark.torch_values_unused("checks the harness itself: it expects torch's run to differ")
def test_the_parity_helper_fails_when_torchs_run_differs_by_1e_3(ranks):
    for message in ranks.run(check_the_helper_fails_on_a_shifted_reference, world_size=2):
        assert "pass torch_differs='why'" in message
