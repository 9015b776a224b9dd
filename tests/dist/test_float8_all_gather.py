"""torchao's float8 training with its float8 all-gather (enable_fsdp_float8_all_gather=True,
emulated on the CPU) on gloo: our units send the float8 data as bytes. Training equals the same
model gathering in float32 and torch's fully_shard gathering in float8, bit for bit (the
weights are cast to float8 for the matmuls either way), with a quarter of the weights'
all-gather bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_compose import fully_shard
from tests.dist.counting import ALL_GATHER, CollectiveCounter
from tests.dist.parity import max_diff_to, rank_share

float8 = pytest.importorskip("torchao.float8")


def float8_model(all_gather: bool, shard=fully_shard) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=True)
    float8.convert_to_float8_training(model, config=config)
    for layer in (model[0], model[2]):
        shard(layer)
    shard(model)
    return model


def check_float8_all_gather() -> dict[str, object]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    models = [float8_model(True), float8_model(False), float8_model(True, torch_fully_shard)]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    sent = []
    for step in range(3):
        x = rank_share(torch.randn(8, 32, generator=torch.Generator().manual_seed(step)))
        for model, optim in zip(models, optims):
            with CollectiveCounter() as counter:
                model(x).pow(2).mean().backward()
            sent.append(counter.bytes[ALL_GATHER])
            optim.step()
            optim.zero_grad()
    return {"vs float32 gathers": max_diff_to(models[0], models[1]),
            "vs torch's": max_diff_to(models[0], models[2]), "bytes": sent[:2]}


def test_float8_all_gather_trains_on_gloo_as_float32_gathers_and_as_fsdp2(ranks):
    result = ranks.run(check_float8_all_gather)[0]
    assert result["vs float32 gathers"] == 0.0 and result["vs torch's"] == 0.0, result
    float8_bytes, float32_bytes = result["bytes"]
    # The weights (32x64 and 64x32), gathered in forward and again in backward, go as 1 byte
    # each instead of 4; the biases as they are.
    assert float32_bytes - float8_bytes == 2 * 3 * (32 * 64 + 64 * 32), result
