"""All-gather codecs: Int8RowCodec sends weights as int8 rows with a scale, the unsharded
weights are exactly those rows rounded, gradients reach the float32 shards as they would
for a model holding the rounded weights, and the all-gather moves about a quarter of the
bytes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compose import Int8RowCodec, fully_shard
from tests.dist.counting import ALL_GATHER, CollectiveCounter, first_forward
from tests.dist.parity import full, per_block
from tests.models import MLP, feature_batch


def rounded(weight: torch.Tensor) -> torch.Tensor:
    """What int8 rows with a per-row absmax scale give back: rows are whole on one rank,
    so the sharded encoding rounds exactly as this does on the whole weight."""
    codec = Int8RowCodec()
    rows, row_numel = weight.shape
    out = torch.empty(1, weight.numel())
    encoded = codec.encode(weight.reshape(-1), rows, row_numel).view(torch.uint8)
    codec.decode(encoded[None], out, rows, row_numel)
    return out.view_as(weight)


def gather_bytes(model: nn.Module, x: torch.Tensor) -> int:
    first_forward(model, x)
    with CollectiveCounter() as comms:
        model(x).sum().backward()
    return comms.bytes[ALL_GATHER]


def check_int8_codec() -> tuple[int, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = (8, 64, 64, 8)
    torch.manual_seed(0)
    ref = MLP(dims)
    ours, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    for model in (ours, plain):
        per_block(model, fully_shard)
    for layer in ours.layers:
        layer.set_all_gather_codec(Int8RowCodec(), params=["weight"])
    with torch.no_grad():  # the reference holds the weights as the codec rounds them
        for layer in ref.layers:
            layer.weight.copy_(rounded(layer.weight))

    x = feature_batch(0, 2 * world)
    ours.layers[0].unshard()
    torch.testing.assert_close(ours.layers[0].weight, ref.layers[0].weight, rtol=0, atol=0)
    ours.layers[0].reshard()
    ref(x).sum().backward()
    ours(x.chunk(world)[rank]).sum().backward()
    for (fqn, p), ref_p in zip(ours.named_parameters(), ref.parameters()):
        assert p.dtype == torch.float32, fqn  # the shards stay full precision
        torch.testing.assert_close(full(p.grad) * world, ref_p.grad, msg=fqn)  # sum, not mean
    return gather_bytes(ours, x[:2]), gather_bytes(plain, x[:2])


def test_int8_codec_rounds_weights_and_quarters_the_bytes(ranks):
    int8, fp32 = ranks.run(check_int8_codec, world_size=2)[0]
    # Weights: 1 byte per element plus 4 per row, against 4 per element; biases as before.
    assert 0.25 < int8 / fp32 < 0.3, (int8, fp32)


def check_codec_refusals() -> list[str]:
    """What a codec, as an all-gather extension, cannot do: each refusal as every rank says it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    said = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    tp = fully_shard(parallelize_module(nn.Linear(8, 8), mesh["tp"], ColwiseParallel()),
                     mesh=mesh["dp"])
    try:
        tp.set_all_gather_codec(Int8RowCodec())
    except NotImplementedError as error:
        said.append(str(error))
    for codec_first in (True, False):
        layer = fully_shard(nn.Linear(8, 8), reshard_after_forward=True)
        if codec_first:
            layer.set_all_gather_codec(Int8RowCodec())
            layer.set_reshard_after_forward(2)
        else:
            layer.set_reshard_after_forward(2)
            layer.set_all_gather_codec(Int8RowCodec())
        try:
            layer(torch.ones(2, 8))
        except NotImplementedError as error:
            said.append(str(error))
    return said


def test_a_codec_refuses_tensor_parallel_and_smaller_post_forward_groups_on_every_rank(ranks):
    results = ranks.run(check_codec_refusals, world_size=4)
    assert all(said == results[0] for said in results), results  # every rank alike
    tp, *post_forward = results[0]
    assert "['weight', 'bias'] are tensor-parallel" in tp and "Leave them out of `params`" in tp
    assert len(post_forward) == 2
    for message in post_forward:
        assert "parameter 'weight' gathers through an all-gather extension" in message
        assert "reshard_after_forward=<int>" in message and "pass a bool" in message
