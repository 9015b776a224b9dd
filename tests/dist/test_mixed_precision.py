"""Mixed precision: gather and compute in param_dtype, reduce in reduce_dtype, keep float32
shards and optimizer state; in parity with torch's fully_shard and a manual reference."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from tests.dist.parity import (
    assert_close_to,
    backward,
    optimizer_step,
    rank_share,
    three_models,
    train_and_compare,
)
from tests.models import MLP, Transformer, feature_batch, lm_loss, mse_loss, token_batch

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.4%); a few layers and AdamW steps
# away from the float32 reference, differences of a few percent are bf16 rounding.
BF16_VS_FLOAT32 = {"rtol": 5e-2, "atol": 5e-2}


def check_bf16_matches_torch() -> list[tuple[float, float]]:
    results = []
    for policy in (BF16, MixedPrecisionPolicy(param_dtype=torch.bfloat16)):
        results.append(tuple(train_and_compare(
            MLP, mse_loss, feature_batch, mp_policy=policy, reference_tolerance=BF16_VS_FLOAT32,
        )))
        results.append(tuple(train_and_compare(
            Transformer, lm_loss, token_batch, mp_policy=policy,
            reference_tolerance=BF16_VS_FLOAT32,
        )))
    return results


def test_bf16_trains_like_torch_fully_shard(ranks):
    for errors in ranks.run(check_bf16_matches_torch, world_size=2):
        assert all(vs_torch == 0.0 for _, vs_torch in errors), errors


def check_against_manual_bf16_reference(reduce_dtype: torch.dtype) -> None:
    """The reference does by hand what every rank does: a bf16 copy of the float32
    weights computes on that rank's share; gradients are averaged in reduce_dtype; the
    float32 weights step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    master = MLP()
    ours = copy.deepcopy(master)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for layer in ours.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(ours, mp_policy=policy)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (master, ours)]
    for step in range(3):
        shares = feature_batch(step, 2 * world).chunk(world)
        total = [torch.zeros_like(p, dtype=reduce_dtype) for p in master.parameters()]
        for share in shares:
            low = copy.deepcopy(master).to(torch.bfloat16)
            prediction = low(share.to(torch.bfloat16)).float()  # as the root casts inputs
            (prediction - share[:, :1]).pow(2).mean().backward()
            for t, p in zip(total, low.parameters()):
                t.add_(p.grad.to(reduce_dtype))
        for p, t in zip(master.parameters(), total):
            p.grad = (t / world).to(torch.float32)
        mse_loss(ours, shares[rank]).backward()
        for fqn, p in ours.named_parameters():
            assert p.dtype == p.grad.dtype == torch.float32, fqn  # shards stay float32
        # float32 reduction: only the order of the sum differs; bf16 reduction rounds each
        # partial sum to bf16.
        tol = {} if reduce_dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
        assert_close_to(ours, master, grads=True, where=f"step {step}", **tol)
        optimizer_step(optims)


def test_bf16_compute_float32_reduce_matches_manual_reference(ranks):
    ranks.run(check_against_manual_bf16_reference, world_size=2, reduce_dtype=torch.float32)


def test_bf16_compute_bf16_reduce_matches_manual_reference(ranks):
    ranks.run(check_against_manual_bf16_reference, world_size=2, reduce_dtype=torch.bfloat16)


def bf16_blocks_float32_root(model: nn.Module, shard) -> None:
    """Blocks compute in bf16 and hand float32 back to the float32 root (norm and head)."""
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    for block in model.blocks:
        shard(block, mp_policy=policy)
    shard(model)


def check_units_with_different_policies() -> tuple[float, float]:
    return tuple(train_and_compare(
        lambda: Transformer(depth=3), lm_loss, token_batch, wrap=bf16_blocks_float32_root,
        reference_tolerance=BF16_VS_FLOAT32,
    ))


def test_units_with_different_policies_in_one_model(ranks):
    for _, vs_torch in ranks.run(check_units_with_different_policies, world_size=2):
        assert vs_torch == 0.0


def check_output_dtype_and_input_cast() -> None:
    model = MLP()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(model.layers[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mp_policy=policy)
    seen = []
    model.layers[0].register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    with torch.no_grad():  # afterwards every unit is sharded again, even the root
        out = model(feature_batch(0, 4))  # float32 in: the root's pre-forward casts to bf16
    assert out.dtype == torch.float32 and seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_output_dtype_and_forward_input_cast(ranks):
    ranks.run(check_output_dtype_and_input_cast, world_size=2)


def check_accumulation_without_sync_in_reduce_dtype() -> float:
    """bf16 compute, float32 reduce: micro-batch gradients are summed in float32 before the
    reduction, as torch's fully_shard does; the result equals it bit for bit."""
    world = dist.get_world_size()
    _, ours, theirs = three_models(MLP, mp_policy=BF16)
    for micro in range(4):
        x = rank_share(feature_batch(micro, 2 * world))
        for model in (ours, theirs):
            model.set_requires_gradient_sync(micro == 3)
            mse_loss(model, x).backward()
    for (fqn, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), fqn
    return max(p.grad.full_tensor().abs().max().item() for p in ours.parameters())


def test_accumulation_without_sync_sums_in_reduce_dtype(ranks):
    assert all(g > 0 for g in ranks.run(check_accumulation_without_sync_in_reduce_dtype))


class Mixed(nn.Module):
    """A float32 layer, a bfloat16 layer and a frozen float64 scale, in one unit."""

    def __init__(self, second_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 7)
        self.second = nn.Linear(7, 5).to(second_dtype)
        self.scale = nn.Parameter(
            torch.linspace(0.5, 1.5, 5, dtype=torch.float64), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x)).to(self.second.weight.dtype)
        return (self.second(h).double() * self.scale).float()


def check_mixed_dtypes_in_one_unit() -> tuple[float, float, list[str]]:
    """Parameters of different dtypes share a unit without a param_dtype: each gathers and
    computes in its own dtype; gradients (float32 and bfloat16) reduce in float32. The
    frozen float64 parameter next to float32 ones is torch's "mixed dtypes, no-grad param"
    case: compared with torch's fully_shard there."""
    world = dist.get_world_size()
    ref = Mixed()
    ours = copy.deepcopy(ref)
    fully_shard(ours)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        backward((ref, ours), feature_batch(step, 2 * world), mse_loss)
        assert_close_to(ours, ref, grads=True, where=step, rtol=2e-2, atol=2e-2)
        optimizer_step(optims)
    dtypes = sorted({str(p.dtype) for p in ours.parameters()})
    errors = train_and_compare(lambda: Mixed(torch.float32), mse_loss, feature_batch,
                               wrap=lambda model, shard: shard(model))
    return assert_close_to(ours, ref, rtol=2e-2, atol=2e-2), errors.vs_torch, dtypes


def test_mixed_dtypes_in_one_unit(ranks):
    for vs_reference, vs_torch, dtypes in ranks.run(check_mixed_dtypes_in_one_unit, world_size=2):
        assert vs_reference < 2e-2 and vs_torch == 0.0
        assert dtypes == ["torch.bfloat16", "torch.float32", "torch.float64"]


class Gated(nn.Module):
    """A gate computed in float32 (its module casts its input up) between bf16 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 7)
        self.gate = nn.Linear(7, 1)
        self.out = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        return self.out(h * torch.sigmoid(self.gate(h.float())).to(h.dtype))


GATE_SHAPES = {(1, 7), (1,)}  # the gate's parameters, and only they, have these shapes


def keep_gate(param: nn.Parameter) -> torch.dtype | None:
    return param.dtype if tuple(param.shape) in GATE_SHAPES else None


def check_param_dtype_override() -> tuple[float, list[str]]:
    """torch 2.15's param_dtype_override_fn: the gate's parameters stay float32 while the
    rest compute in bfloat16 (on 2.15 in parity with torch's fully_shard; on older torch,
    ours in both seats: the single-process comparison still holds)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=keep_gate)
    torch_has_it = "param_dtype_override_fn" in {
        f.name for f in dataclasses.fields(TorchMixedPrecisionPolicy)
    }
    errors = train_and_compare(
        Gated, mse_loss, feature_batch, mp_policy=policy, reference_tolerance=BF16_VS_FLOAT32,
        wrap=lambda model, shard: shard(model),
        shard_fns=(fully_shard, torch_fully_shard if torch_has_it else fully_shard),
    )
    model = Gated()
    fully_shard(model, mp_policy=policy)
    model.unshard()
    dtypes = sorted({f"{name.split('.')[0]}: {p.dtype}" for name, p in model.named_parameters()})
    with pytest.raises(ValueError, match=r"param_dtype_override_fn returned torch\.float16 for "
                       r"parameter 'layers\.0\.weight'"):
        fully_shard(MLP(), mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16))
    return errors.vs_torch, dtypes


def test_param_dtype_override(ranks):
    for vs_torch, dtypes in ranks.run(check_param_dtype_override, world_size=2):
        assert vs_torch == 0.0
        assert dtypes == ["first: torch.bfloat16", "gate: torch.float32", "out: torch.bfloat16"]
