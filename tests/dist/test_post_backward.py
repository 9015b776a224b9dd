"""When a unit's backward ends: with the last gradient accumulated into its parameters, or,
in a unit with frozen parameters or parameters a backward left without a gradient, with
the backward of its forward inputs. Either way the unit reduces and reshards as soon as it
is done (the reduce-scatters in torch's order) and trains like single-process; the limit
of the first way (a detached alias of a parameter read later) fails loudly. Ranks that
leave different parameters without gradient: test_comm_setters.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_compose import fully_shard
from tests.dist.counting import MATMUL, GatherOrder, all_gather, reduce_scatter
from tests.dist.parity import (
    assert_close_to,
    backward,
    max_diff_to,
    per_block,
    three_models,
    train_and_compare,
)
from tests.models import MLP, feature_batch, mse_loss


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update. Autograd computes the update's
    gradients before the frozen weight's part of the input gradient, which still needs the
    unsharded weight: the unit must not reshard once its trainable parameters have theirs."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.base.requires_grad_(False)
        self.down = nn.Linear(dim_in, rank, bias=False)
        self.up = nn.Linear(rank, dim_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class LoRAMLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (8, 7, 5, 3)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(dims[-1], 1)  # trainable, in the root unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def check_lora_parity() -> tuple[float, float]:
    return train_and_compare(LoRAMLP, mse_loss, feature_batch, steps=4)


def test_units_with_frozen_parameters_train_like_single_process_and_torch(ranks):
    vs_reference, vs_torch = ranks.run(check_lora_parity, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6


class Gated(nn.Module):
    """A unit of two tensor inputs, one by keyword, with a frozen bias."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out)
        self.linear.bias.requires_grad_(False)
        self.gate = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor, *, context: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * torch.sigmoid(self.gate(context))


class FrozenBiases(nn.Module):
    """Units with a frozen parameter, whose backward ends with their inputs' nodes: one
    called with a leaf tensor that requires grad, the others with two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 7), Gated(7, 5), Gated(5, 3)])
        self.layers[0].bias.requires_grad_(False)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.layers[0](x.detach().requires_grad_()))
        for layer in self.layers[1:]:
            x = F.relu(layer(x, context=x.flip(-1)))
        return self.head(x)


def check_frozen_biases_parity() -> tuple[float, float]:
    return train_and_compare(FrozenBiases, mse_loss, feature_batch)


def test_units_with_frozen_parameters_and_leaf_or_several_inputs_train_like_torch(ranks):
    vs_reference, vs_torch = ranks.run(check_frozen_biases_parity, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6


class SometimesExtra(nn.Linear):
    """A linear layer with an extra bias that only some forwards add."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__(dim_in, dim_out)
        self.extra = nn.Parameter(torch.zeros(dim_out))
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + self.extra if self.use_extra else y


class SometimesUnused(MLP):
    """Layer 1's extra bias is used in every other forward only."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[1] = SometimesExtra(7, 5)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.layers[1].use_extra = self.calls % 2 == 0
        self.calls += 1
        return super().forward(x)


def check_sometimes_unused_parity() -> tuple[float, float]:
    return train_and_compare(SometimesUnused, mse_loss, feature_batch, steps=4)


def test_parameters_without_gradient_in_some_steps_train_like_single_process_and_torch(ranks):
    vs_reference, vs_torch = ranks.run(check_sometimes_unused_parity, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6


def backward_orders(make_model, shard, steps: int) -> list[list[int | str]]:
    """Per step, the backward's all-gathers, reduce-scatters and matrix multiplies."""
    torch.manual_seed(0)
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    per_block(model, lambda m, **kw: shard(m, mesh=mesh, **kw))
    orders = []
    for step in range(steps):
        loss = mse_loss(model, feature_batch(step, 2))
        with GatherOrder(reduce_scatters=True) as order:
            loss.backward()
        orders.append(order.sizes)
    return orders


def check_lora_order() -> tuple[list, list]:
    return tuple(backward_orders(LoRAMLP, shard, steps=2)
                 for shard in (fully_shard, torch_fully_shard))


@pytest.mark.torch_values_unused("compares the order of reductions with torch's")
def test_units_with_frozen_parameters_reduce_after_their_inputs_backward(ranks):
    """The LoRA units reduce where torch's do, after their inputs' backward; the root,
    whose parameters (the head) all train, as soon as they have their gradients."""
    ours, theirs = ranks.run(check_lora_order, world_size=2)[0]
    rs_root = reduce_scatter(8)  # the head's 3 + 1 parameters, padded for 2 ranks
    # The last LoRA layer's gather (its frozen 3 x 5 base and bias and its rank-2 factors,
    # padded to whole rows for 2 ranks: 42 values), the head's two matrix multiplies, then
    # the root's reduce-scatter, before any LoRA layer's inputs' backward.
    last_layer = all_gather(42)
    for step_ours, step_theirs in zip(ours, theirs):
        assert step_ours[:4] == [last_layer, MATMUL, MATMUL, rs_root], step_ours
        assert step_theirs[-2] == rs_root, step_theirs
        assert without(rs_root, step_ours) == without(rs_root, step_theirs)


def check_sometimes_unused_order() -> tuple[list, list]:
    return tuple(backward_orders(SometimesUnused, shard, steps=4)
                 for shard in (fully_shard, torch_fully_shard))


@pytest.mark.torch_values_unused("compares the order of reductions with torch's")
def test_a_unit_that_left_a_parameter_without_gradient_reduces_after_its_inputs(ranks):
    """Step 1 uses every parameter: each unit reduces with its last gradient, in torch's
    order. Step 2 leaves layer 1's extra parameter without one: the unit reduces at the end
    of backward. From then on it reduces once its inputs' backward ran, as torch does."""
    ours, theirs = ranks.run(check_sometimes_unused_order, world_size=2)[0]
    assert ours[0] == theirs[0]
    rs_layer1 = reduce_scatter(48)  # the weight and bias without the extra, padded for 2 ranks
    assert ours[1][-1] == rs_layer1 and theirs[1][-1] != rs_layer1, (ours[1], theirs[1])
    assert without(rs_layer1, ours[1]) == without(rs_layer1, theirs[1])
    assert ours[2:] == theirs[2:]


def without(item: str, order: list[int | str]) -> list[int | str]:
    return [x for x in order if x != item]


class DetachedAlias(nn.Linear):
    """Reads its weight through a detached alias whose backward runs after the weight's
    gradient is accumulated (the node was made earlier in forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x @ self.weight.detach().t()
        return super().forward(x) + z


def check_detached_alias_fails_loudly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), DetachedAlias(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    loss = model(feature_batch(0, 2)).sum()
    with pytest.raises(RuntimeError, match="storage of size 0"):
        loss.backward()


def test_a_detached_alias_read_after_the_last_gradient_fails_loudly(ranks):
    """The documented limit of units whose parameters all train: an error, not wrong values."""
    ranks.run(check_detached_alias_fails_loudly, world_size=2)


def optimizer_in_backward(model: nn.Module) -> list[int]:
    """An optimizer per parameter, stepped by a post-accumulate-grad hook that then frees
    the gradient (the optimizer-in-backward pattern); returns the per-parameter step counts."""
    counts = [0] * len(list(model.parameters()))
    for i, p in enumerate(model.parameters()):
        optim = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)

        def step(param: torch.Tensor, optim: torch.optim.Optimizer = optim, i: int = i) -> None:
            assert param.grad is not None
            optim.step()
            param.grad = None
            counts[i] += 1

        p.register_post_accumulate_grad_hook(step)
    return counts


def check_optimizer_in_backward(steps: int) -> tuple[float, float, list[int]]:
    world = dist.get_world_size()
    ref, ours, theirs = three_models(MLP)
    counts = [optimizer_in_backward(m) for m in (ref, ours, theirs)]
    for step in range(steps):
        backward((ref, ours, theirs), feature_batch(step, 2 * world), mse_loss)
        for m in (ours, theirs):
            assert all(p.grad is None for p in m.parameters()), (
                "each hook ran and freed its gradient"
            )
    assert counts[1] == counts[2] == counts[0]
    return assert_close_to(ours, ref), max_diff_to(ours, theirs), counts[1]


def test_post_accumulate_grad_hooks_on_sharded_params_run_after_the_reduction(ranks):
    results = ranks.run(check_optimizer_in_backward, world_size=2, steps=3)
    for vs_reference, vs_torch, counts in results:
        assert vs_reference < 1e-6 and vs_torch == 0.0
        assert counts == [3] * 8  # once per parameter and backward
