"""Custom all-gather and reduce-scatter per unit, with torch's fully_shard interface: the
same comm objects give the same training under fsdp_compose and torch's fully_shard."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.dist.comms import AllReduceThenSlice, CountingAllGather
from tests.dist.parity import (
    Shard,
    assert_close_to,
    backward,
    max_diff_to,
    optimizer_step,
    per_block,
    three_models,
    train_and_compare,
)
from tests.models import Transformer, lm_loss, token_batch


def with_custom_comms(comms: list, divide_factor: float | None = None) -> callable:
    def wrap(model: nn.Module, shard: Shard) -> None:
        per_block(model, shard)
        premul = None if divide_factor is None else 1.0 / divide_factor
        gather, reduce = CountingAllGather(), AllReduceThenSlice(premul)
        comms.append((gather, reduce))
        for module in model.modules():
            if hasattr(module, "set_custom_all_gather"):  # annotated, by us or by torch
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(reduce)
                if divide_factor is not None:
                    module.set_gradient_divide_factor(divide_factor)
    return wrap


def check_custom_comms() -> tuple[tuple[float, float], list[tuple[int, int, int]]]:
    comms: list = []
    errors = train_and_compare(
        lambda: Transformer(depth=2), lm_loss, token_batch, steps=2, wrap=with_custom_comms(comms)
    )
    return errors, [(g.calls, g.allocations, r.calls) for g, r in comms]


def test_custom_comms_train_like_torch_with_the_same_comms(ranks):
    (vs_reference, vs_torch), (ours, theirs) = ranks.run(check_custom_comms, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6
    # Per step: 3 units gathered in forward, 2 blocks again in backward; 3 reductions.
    assert ours == theirs == (10, 10, 6)


def check_divide_factor_op(premul_backend: bool) -> tuple[float, list[set[str]]]:
    """A divide factor of 3 over 2 ranks, ours and torch's through the same custom
    reduce-scatter, two SGD steps; `premul_backend`: gloo taken for a backend with
    PREMUL_SUM, as NCCL. Gradients are the single-process ones times world / 3."""
    from fsdp_compose.comm import collectives

    backends = collectives._PREMUL_SUM_BACKENDS
    if premul_backend:
        collectives._PREMUL_SUM_BACKENDS = backends | {"gloo"}
    try:
        comms: list = []
        models = ref, ours, theirs = three_models(
            lambda: Transformer(depth=2), wrap=with_custom_comms(comms, divide_factor=3.0)
        )
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        world, vs_torch = dist.get_world_size(), 0.0
        for step in range(2):
            backward(models, token_batch(step, 2 * world), lm_loss)
            for p in ref.parameters():
                p.grad.mul_(world / 3.0)
            assert_close_to(ours, ref, grads=True, where=step)
            vs_torch = max(vs_torch, max_diff_to(ours, theirs, grads=True))
            optimizer_step(optims)
            vs_torch = max(vs_torch, max_diff_to(ours, theirs))
    finally:
        collectives._PREMUL_SUM_BACKENDS = backends
    return vs_torch, [reduce.ops for _, reduce in comms]


def test_a_divide_factor_reduces_with_premul_sum_where_the_backend_has_it(ranks):
    """torch's fully_shard asks for ReduceOp.PREMUL_SUM(1/factor) on every backend (gloo
    refuses it); ours where the backend has it (NCCL), else a pre-scaled SUM. Both train
    alike through a reduce-scatter that implements PREMUL_SUM."""
    vs_torch, (ours, theirs) = ranks.run(check_divide_factor_op, premul_backend=True)[0]
    assert vs_torch == 0.0
    assert ours == theirs == {"RedOpType.PREMUL_SUM"}
    vs_torch, (ours, theirs) = ranks.run(check_divide_factor_op, premul_backend=False)[0]
    assert vs_torch == 0.0
    assert ours == {"RedOpType.SUM"} and theirs == {"RedOpType.PREMUL_SUM"}
