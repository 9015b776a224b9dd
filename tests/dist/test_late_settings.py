"""Settings applied after the first step take effect as torch's do and lose no gradient:
every FSDPModule setter, and share_comm_ctx, called between steps on ours and on torch's
fully_shard alike, trains exactly as torch's (0.0) and like single-process training.
Nothing a setter changes may be a copy taken at the first forward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from fsdp_compose import FSDPModule, fully_shard, share_comm_ctx
from tests.dist.comms import AllReduceThenSlice, CountingAllGather
from tests.dist.parity import (
    assert_close_to,
    backward,
    make_mesh,
    max_diff_to,
    optimizer_step,
    three_models,
)
from tests.models import MLP, feature_batch, mse_loss
from tests.torch_support import versus_torch

Setting = Callable[[nn.Module], None]  # applied to a root annotated by us or by torch


def annotated(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]


def on_every_unit(call: Callable[[nn.Module], None]) -> Setting:
    return lambda model: [call(m) for m in annotated(model)] and None


def halve(grad: torch.Tensor) -> None:
    grad.mul_(0.5)


def prefetch_next(model: nn.Module) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[max(i - 1, 0) : i])


def custom_comms(model: nn.Module) -> None:
    gather, reduce = CountingAllGather(), AllReduceThenSlice()
    for m in annotated(model):
        m.set_custom_all_gather(gather)
        m.set_custom_reduce_scatter(reduce)


# Each FSDPModule setter that torch's has, with a value that changes what the next steps do.
# (set_requires_gradient_sync, set_is_last_backward and set_requires_all_reduce change when
# gradients are reduced: test_edge_cases and test_strategies step through them between
# micro-batches; set_unshard_in_backward needs a unit its backward does not use:
# test_collectives.)
SETTINGS: dict[str, Setting] = {
    "set_reshard_after_forward": lambda model: model.set_reshard_after_forward(False),
    "set_reshard_after_backward": lambda model: model.set_reshard_after_backward(False),
    "set_modules_to_forward_prefetch": prefetch_next,
    "set_gradient_divide_factor": on_every_unit(lambda m: m.set_gradient_divide_factor(2.0)),
    "set_force_sum_reduction_for_comms":
        on_every_unit(lambda m: m.set_force_sum_reduction_for_comms(True)),
    "set_reduce_scatter_unused_params":
        on_every_unit(lambda m: m.set_reduce_scatter_unused_params(True)),
    "set_all_reduce_hook": on_every_unit(lambda m: m.set_all_reduce_hook(halve)),
    "set_custom_comms": custom_comms,
    "set_reduce_scatter_max_input_buffers":
        lambda model: model.set_reduce_scatter_max_input_buffers(2),
    "set_separate_reduce_scatter_group":
        on_every_unit(lambda m: m.set_separate_reduce_scatter_group(True)),
}


def setter_of(name: str) -> str:
    return "set_custom_all_gather" if name == "set_custom_comms" else name


def check_setting_after_a_step(name: str) -> float:
    """A step, the setting on ours and torch's, two more steps; ours against torch's and,
    where the setting keeps the averaged gradient, against single-process. On a torch
    whose FSDPModule lacks the setter, ours twice: single-process is the comparison."""
    models = ref, ours, theirs = three_models(
        MLP, make_mesh(), shard_fns=versus_torch(setter_of(name))
    )
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    world = dist.get_world_size()
    vs_torch = 0.0
    for step in range(3):
        if step == 1:
            for model in (ours, theirs):
                SETTINGS[name](model)
        backward(models, feature_batch(step, 2 * world), mse_loss)
        for model in (ours, theirs):  # after a backward that kept them unsharded
            for m in annotated(model):
                m.reshard()
        vs_torch = max(vs_torch, max_diff_to(ours, theirs, grads=True))
        if step == 0 or name != "set_all_reduce_hook":  # which halves the gradients
            assert_close_to(ours, ref, grads=True, where=(name, step))
        optimizer_step(optims)
        vs_torch = max(vs_torch, max_diff_to(ours, theirs))
    return vs_torch


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_setting_after_the_first_step_acts_as_torchs(ranks, name):
    assert ranks.run(check_setting_after_a_step, name=name, world_size=2)[0] == 0.0, name


class Stage(nn.Sequential):
    """A pipeline stage: its first layer a unit, the stage the root."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def two_stages(shard: Callable[..., object]) -> list[nn.Module]:
    torch.manual_seed(0)
    stages = [Stage(), Stage()]
    if shard is None:
        return stages
    mesh = make_mesh()
    for stage in stages:
        shard(stage[0], mesh=mesh)
        shard(stage, mesh=mesh)
    return stages


def check_share_comm_ctx_after_a_step(one_backward: bool) -> tuple[float, list[str]]:
    """Two roots (pipeline stages on one rank) step once, then share one comm context;
    every later backward keeps every gradient, with one backward call through both stages
    or one per stage. Against torch's with one backward: with one per stage, torch's own
    backward prefetch raises IndexError (torch 2.13: `post_forward_order[curr_index - 1]`),
    and an older torch has no share_comm_ctx, so single-process training is the comparison
    there."""
    import torch.distributed.fsdp as torch_fsdp

    world, rank = dist.get_world_size(), dist.get_rank()
    runs = {"ours": two_stages(fully_shard), "ref": two_stages(None)}
    with_torch = one_backward and hasattr(torch_fsdp, "share_comm_ctx")
    if with_torch:
        runs["torch"] = two_stages(torch_fsdp.fully_shard)
    optims = {k: torch.optim.SGD([p for s in v for p in s.parameters()], lr=0.1)
              for k, v in runs.items()}
    missing: list[str] = []
    vs_torch = 0.0
    for step in range(3):
        if step == 1:
            share_comm_ctx(runs["ours"])
            if with_torch:
                torch_fsdp.share_comm_ctx(runs["torch"])
        batch = feature_batch(step, 2 * world)
        for key, (a, b) in runs.items():
            x = batch if key == "ref" else batch.chunk(world)[rank]
            scale = 1.0 / len(batch) if key == "ref" else 1.0 / len(x)
            losses = [a(x).sum() * scale, b(x).sum() * scale]
            if one_backward:
                sum(losses).backward()
            else:
                for loss in losses:
                    loss.backward()
        a, b = runs["ours"]
        missing += [f"step {step} {n}" for s, tag in ((a, "a"), (b, "b"))
                    for n, p in s.named_parameters(prefix=tag) if p.grad is None]
        if with_torch:
            c, d = runs["torch"]
            vs_torch = max(vs_torch, max_diff_to(a, c, grads=True), max_diff_to(b, d, grads=True))
        for ours, ref in zip(runs["ours"], runs["ref"]):
            assert_close_to(ours, ref, grads=True, where=step)
        optimizer_step(optims.values())
    return vs_torch, missing


@pytest.mark.parametrize("one_backward", [True, False], ids=["one backward", "a backward per root"])
def test_share_comm_ctx_after_a_step_keeps_every_gradient(ranks, one_backward):
    results = ranks.run(check_share_comm_ctx_after_a_step, one_backward=one_backward)
    for vs_torch, missing in results:
        assert missing == [] and vs_torch == 0.0, (missing, vs_torch)
