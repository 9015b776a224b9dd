"""Edge cases of the core runtime, each in parity with single-process training and torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compose import FSDPModule, fully_shard, register_fsdp_forward_method
from tests.dist.parity import (
    assert_close_to,
    backward,
    max_diff_to,
    optimizer_step,
    rank_share,
    three_models,
    train_and_compare,
    two_models,
)
from tests.models import MLP, Transformer, feature_batch, lm_loss, mse_loss, token_batch


def check_shards_follow_torch_chunk() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    originals = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    for fqn, p in model.named_parameters():
        chunks = torch.chunk(originals[fqn], world)
        expected = chunks[rank] if rank < len(chunks) else originals[fqn][:0]
        assert isinstance(p, DTensor) and p.placements[0].is_shard(0), fqn
        assert torch.equal(p.to_local(), expected), fqn
        assert torch.equal(p.full_tensor(), originals[fqn]), fqn


def test_shards_follow_torch_chunk_with_uneven_and_empty_shards(ranks):
    ranks.run(check_shards_follow_torch_chunk, world_size=4)


def frozen_first_weight_mlp() -> MLP:
    model = MLP()
    model.layers[0].weight.requires_grad_(False)
    model.layers[2].bias.requires_grad_(False)
    return model


def check_frozen_and_trainable_params() -> None:
    train_and_compare(frozen_first_weight_mlp, mse_loss, feature_batch)


def test_frozen_and_trainable_params_in_one_unit(ranks):
    ranks.run(check_frozen_and_trainable_params, world_size=2)


class ComplexMLP(nn.Module):
    """Complex parameters: the collectives send them as real pairs."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, dtype=torch.cfloat) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.cfloat)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def complex_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x).abs().pow(2).mean()


def check_complex_params() -> None:
    errors = train_and_compare(ComplexMLP, complex_loss, feature_batch)
    assert errors.vs_torch == 0.0, errors


def test_complex_params(ranks):
    ranks.run(check_complex_params, world_size=2)


def check_tied_weights() -> None:
    train_and_compare(lambda: Transformer(tie_weights=True), lm_loss, token_batch)


def test_tied_weights_in_one_unit(ranks):
    ranks.run(check_tied_weights, world_size=2)


class Nested(nn.Module):
    """Three levels of units: inner Linear, the Sequential around it, the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 6)
        self.middle = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        self.out = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.middle(F.relu(self.inp(x)))))


def wrap_nested(model: nn.Module, shard) -> None:
    shard(model.middle[2])
    shard(model.middle)
    shard(model)


def check_nested_units() -> None:
    train_and_compare(Nested, mse_loss, feature_batch, wrap=wrap_nested)


def test_nested_units(ranks):
    ranks.run(check_nested_units, world_size=2)


class AlternatingHeads(nn.Module):
    """Uses head_a on odd calls and head_b on even ones: one unit idles each step."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 6)
        self.head_a, self.head_b = nn.Linear(6, 1), nn.Linear(6, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        head = self.head_a if self.calls % 2 else self.head_b
        return head(F.relu(self.trunk(x)))


def wrap_heads(model: nn.Module, shard) -> None:
    shard(model.head_a)
    shard(model.head_b)
    shard(model)


def check_unit_not_called() -> None:
    train_and_compare(AlternatingHeads, mse_loss, feature_batch, steps=4, wrap=wrap_heads)


def test_unit_not_called_in_a_step(ranks):
    ranks.run(check_unit_not_called, world_size=2)


class UnusedParam(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.layers[1].unused = nn.Parameter(torch.ones(3, 2))


def check_unused_param() -> None:
    train_and_compare(UnusedParam, mse_loss, feature_batch)


def test_unused_param_keeps_no_grad(ranks):
    ranks.run(check_unused_param, world_size=2)


def two_forward_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2)
    return (mse_loss(model, first) + mse_loss(model, second)) / 2


def check_two_forwards() -> None:
    for reshard in (True, False):
        train_and_compare(MLP, two_forward_loss, feature_batch, reshard_after_forward=reshard)


def test_two_forwards_before_one_backward(ranks):
    ranks.run(check_two_forwards, world_size=2)


class ScaledMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.scale)


def check_buffers() -> None:
    train_and_compare(ScaledMLP, mse_loss, feature_batch)
    model = ScaledMLP()
    fully_shard(model)
    assert type(model.scale) is torch.Tensor and "scale" in model.state_dict()


def test_buffers_stay_plain_tensors_and_train(ranks):
    ranks.run(check_buffers, world_size=2)


def loss_after_inference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forwards without grad, in inference mode and in eval, then a training forward."""
    with torch.no_grad():
        model(x)
    with torch.inference_mode():
        model(x)
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    if isinstance(model, FSDPModule):
        stray = [fqn for fqn, p in model.named_parameters() if not isinstance(p, DTensor)]
        assert not stray, f"left unsharded after inference: {stray}"
    return mse_loss(model, x)


def check_inference_then_training() -> None:
    train_and_compare(MLP, loss_after_inference, feature_batch)


def test_inference_forwards_leave_nothing_unsharded(ranks):
    ranks.run(check_inference_then_training, world_size=2)


def check_gradient_accumulation(sync_each_micro_batch: bool) -> None:
    world = dist.get_world_size()
    models = ref, ours, theirs = three_models(MLP)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(2):
        for micro in range(3):
            last = micro == 2
            for model in (ours, theirs):
                model.set_requires_gradient_sync(sync_each_micro_batch or last)
            backward(models, feature_batch(10 * step + micro, 2 * world), mse_loss)
            if not (sync_each_micro_batch or last):
                assert all(p.grad is None for p in ours.parameters()), "reduced without sync"
        assert_close_to(ours, ref, grads=True, where=step)
        assert max_diff_to(ours, theirs, grads=True) == 0.0, step
        optimizer_step(optims)
        assert_close_to(ours, ref, where=step)


def test_gradient_accumulation_without_sync(ranks):
    ranks.run(check_gradient_accumulation, world_size=2, sync_each_micro_batch=False)


def test_gradient_accumulation_with_sync(ranks):
    ranks.run(check_gradient_accumulation, world_size=2, sync_each_micro_batch=True)


def check_manual_backward_finalization() -> None:
    """torch 2.15's flow: every micro-batch's backward without gradient sync, sync enabled
    again, then one finalize_backward reduces the sum; the same gradients as torch's
    fully_shard syncing on the last backward, and as single-process."""
    world = dist.get_world_size()
    models = ref, ours, theirs = three_models(MLP)
    ours.finalize_backward()  # before the first forward: nothing to do
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(2):
        ours.set_manual_backward_finalization(True)
        ours.set_requires_gradient_sync(False)
        for micro in range(3):
            theirs.set_requires_gradient_sync(micro == 2)
            backward(models, feature_batch(10 * step + micro, 2 * world), mse_loss)
        assert all(p.grad is None for p in ours.parameters()), "reduced before finalizing"
        ours.set_requires_gradient_sync(True)
        ours.finalize_backward(async_op=True).wait()
        assert max_diff_to(ours, theirs, grads=True) == 0.0, step
        assert_close_to(ours, ref, grads=True, where=step)
        optimizer_step(optims)
    with pytest.raises(RuntimeError, match=r"is not a root; call it on the root module"):
        ours.layers[0].set_manual_backward_finalization(True)
    mse_loss(ours, feature_batch(0, 2))
    with pytest.raises(RuntimeError, match=r"finalize_backward: units .* are between a forward "
                       r"and its backward"):
        ours.finalize_backward()


def test_manual_backward_finalization(ranks):
    ranks.run(check_manual_backward_finalization, world_size=2)


def check_backwards_add_into_changed_grads() -> None:
    """Without zero_grad(set_to_none=True) between them, backwards add into the .grads as
    they are: zeroed in place, one replaced by a copy, one dropped."""
    world = dist.get_world_size()
    models = ref, ours, theirs = three_models(MLP)

    def zero_in_place(model: nn.Module) -> None:
        model.zero_grad(set_to_none=False)

    def replace_one(model: nn.Module) -> None:
        weight = model.get_parameter("layers.0.weight")
        weight.grad = weight.grad.clone()

    def drop_one(model: nn.Module) -> None:
        model.get_parameter("layers.2.bias").grad = None

    for step, change in enumerate((None, zero_in_place, replace_one, drop_one)):
        for model in models:
            if change is not None:
                change(model)
        backward(models, feature_batch(step, 2 * world), mse_loss)
        after = f"after {change and change.__name__}"
        assert_close_to(ours, ref, grads=True, where=after)
        assert max_diff_to(ours, theirs, grads=True) == 0.0, after


def test_backwards_add_into_changed_grads(ranks):
    ranks.run(check_backwards_add_into_changed_grads, world_size=2)


def check_ignored_params() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MLP()
    ours = copy.deepcopy(ref)
    fully_shard(ours, ignored_params={ours.layers[1].bias})
    assert type(ours.layers[1].bias) is nn.Parameter
    assert isinstance(ours.layers[1].weight, DTensor)
    x = feature_batch(0, 2 * world).chunk(world)[rank]
    mse_loss(ref, x).backward()  # the same local data: an ignored grad is not averaged
    mse_loss(ours, x).backward()
    assert torch.equal(ours.layers[1].bias.grad, ref.layers[1].bias.grad)


def test_ignored_params_stay_whole_and_local(ranks):
    ranks.run(check_ignored_params, world_size=2)


def check_explicit_unshard_and_reshard() -> None:
    ref, ours = two_models(MLP)
    handle = ours.layers[0].unshard(async_op=True)
    handle.wait()
    weight = ours.layers[0].weight
    assert type(weight) is nn.Parameter and torch.equal(weight, ref.layers[0].weight)
    assert ours.unshard() is None and type(ours.layers[1].weight) is DTensor  # root only
    x = feature_batch(0, 3)
    torch.testing.assert_close(ours(x), ref(x))
    for module in (ours.layers[0], ours):
        module.reshard()
    assert all(isinstance(p, DTensor) for p in ours.parameters())


def test_explicit_unshard_and_reshard(ranks):
    ranks.run(check_explicit_unshard_and_reshard, world_size=2)


class Scorer(MLP):
    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).sum(dim=1)


def check_registered_forward_method() -> None:
    torch.manual_seed(0)
    ref = Scorer()
    ours = copy.deepcopy(ref)
    fully_shard(ours)
    register_fsdp_forward_method(ours, "score")
    x = feature_batch(0, 2 * dist.get_world_size())
    backward((ref, ours), x, lambda model, batch: model.score(batch).mean())
    assert_close_to(ours, ref, grads=True)


def test_registered_forward_method_gathers_parameters(ranks):
    ranks.run(check_registered_forward_method, world_size=2)


def check_gradient_divide_factors() -> None:
    world = dist.get_world_size()
    grads = []
    for setting in ("default", "sum", "force_sum", "deprecated_sum"):
        _, ours = two_models(MLP)  # torch's needs PREMUL_SUM, which gloo lacks
        for module in ours.modules():
            if isinstance(module, FSDPModule) and setting == "sum":
                module.set_gradient_divide_factor(1.0)
            if isinstance(module, FSDPModule) and setting == "force_sum":
                module.set_force_sum_reduction_for_comms(True)
            if isinstance(module, FSDPModule) and setting == "deprecated_sum":
                with pytest.warns(DeprecationWarning, match="set_gradient_divide_factor"):
                    module.set_reduce_scatter_divide_factor(1.0)
        mse_loss(ours, rank_share(feature_batch(0, 2 * world))).backward()
        grads.append([p.grad.full_tensor() for p in ours.parameters()])
    for default, summed, forced, deprecated in zip(*grads):
        torch.testing.assert_close(summed, default * world)
        torch.testing.assert_close(forced, default)
        assert torch.equal(deprecated, summed)
    # Changed between backwards, the factor applies from the next reduction on.
    _, ours = two_models(MLP)
    batch = rank_share(feature_batch(0, 2 * world))
    mse_loss(ours, batch).backward()
    ours.zero_grad()
    for module in ours.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    mse_loss(ours, batch).backward()
    for after, (_, summed, _, _) in zip(ours.parameters(), zip(*grads)):
        torch.testing.assert_close(after.grad.full_tensor(), summed)


def test_gradient_divide_factor_and_forced_sum(ranks):
    ranks.run(check_gradient_divide_factors, world_size=2)


def check_reshard_after_backward_false() -> None:
    models = ref, ours, theirs = three_models(MLP)
    for model in (ours, theirs):
        model.set_reshard_after_backward(False)
    backward(models, feature_batch(0, 2 * dist.get_world_size()), mse_loss)
    assert all(type(p) is nn.Parameter for p in ours.parameters()), "resharded after backward"
    for model in (ours, theirs):
        for layer in model.layers:
            layer.reshard()
        model.reshard()
    assert_close_to(ours, ref, grads=True)
    assert max_diff_to(ours, theirs, grads=True) == 0.0


def test_reshard_after_backward_false_keeps_unsharded(ranks):
    ranks.run(check_reshard_after_backward_false, world_size=2)


def check_keep_unsharded_storage() -> None:
    """set_keep_unsharded_storage(True): the unsharded parameters keep their data pointers
    across reshard and unshard; training is unchanged."""
    world = dist.get_world_size()
    models = ref, ours, theirs = three_models(MLP)
    ours.set_keep_unsharded_storage(True)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    pointers = set()
    for step in range(3):
        backward(models, feature_batch(step, 2 * world), mse_loss)
        optimizer_step(optims)
        ours.layers[1].unshard()
        pointers.add(ours.layers[1].weight.data_ptr())
        ours.layers[1].reshard()
    assert len(pointers) == 1, pointers
    assert max_diff_to(ours, theirs) == 0.0
    assert_close_to(ours, ref)


def test_keep_unsharded_storage(ranks):
    ranks.run(check_keep_unsharded_storage, world_size=2)


class InPlaceOnInput(nn.Module):
    """Layers that scale their input in place before using it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(InPlaceLinear() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0  # not a leaf: in-place edits of it are allowed
        for layer in self.layers:
            x = layer(x)
        return x


class InPlaceLinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)  # replaces the backward node of the input the unit was handed
        return super().forward(x) * 2.0  # saves nothing the next layer's edit could spoil


def check_in_place_edit_of_a_units_input(frozen_bias: bool) -> float:
    def make_model() -> nn.Module:
        model = InPlaceOnInput()
        for layer in model.layers:
            layer.bias.requires_grad_(not frozen_bias)
        return model

    # torch's fully_shard refuses this (its input function's output is modified in place),
    # so ours runs in both seats and the reference is the single-process model.
    return train_and_compare(make_model, mse_loss, feature_batch,
                             shard_fns=(fully_shard, fully_shard)).vs_reference


@pytest.mark.parametrize("frozen_bias", [False, True])
def test_a_unit_may_edit_its_input_in_place(ranks, frozen_bias):
    """Also in units with a frozen parameter, whose backward ends with a view of the input."""
    vs_reference = ranks.run(check_in_place_edit_of_a_units_input, world_size=2,
                             frozen_bias=frozen_bias)[0]
    assert vs_reference < 1e-6
