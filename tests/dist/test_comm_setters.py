"""The communication setters of torch's FSDPModule that shape gradient reduction and
scheduling: each trains like single-process and like torch's fully_shard with the same
setting, and does what it says (counted where counting shows it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_compose import fully_shard, share_comm_ctx
from tests.dist.parity import Shard, per_block, train_and_compare
from tests.models import MLP, feature_batch, mse_loss
from tests.torch_support import versus_torch


def annotated(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")]


class InFlightReduceScatter:
    """A reduce-scatter (torch's custom comm interface) counting reductions in flight."""

    def __init__(self) -> None:
        self.in_flight = self.most = self.calls = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        work = dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=True
        )
        self.calls += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        counter = self

        class Counted:
            def wait(self) -> bool:
                counter.in_flight -= 1
                return work.wait()

        if async_op:
            return Counted()
        Counted().wait()
        return None


def check_reductions_in_flight(buffers: int | None) -> tuple[float, float, int, int]:
    comms: list[InFlightReduceScatter] = []

    def wrap(model: nn.Module, shard: Shard) -> None:
        per_block(model, shard)
        comm = InFlightReduceScatter()
        comms.append(comm)
        for module in annotated(model):
            module.set_custom_reduce_scatter(comm)
        if buffers is not None:
            model.set_reduce_scatter_max_input_buffers(buffers)

    setters = () if buffers is None else ("set_reduce_scatter_max_input_buffers",)
    shard_fns = versus_torch(*setters)
    errors = train_and_compare(MLP, mse_loss, feature_batch, wrap=wrap, shard_fns=shard_fns)
    return (*errors, comms[0].most, comms[0].calls)


@pytest.mark.parametrize(("buffers", "most"), [(None, 1), (2, 2), (3, 3)])
def test_reductions_run_while_the_next_unit_computes(ranks, buffers, most):
    """Each unit's reduce-scatter is left in flight; at most `buffers` (default 1) at once."""
    vs_reference, vs_torch, in_flight, calls = ranks.run(
        check_reductions_in_flight, world_size=2, buffers=buffers
    )[0]
    assert in_flight == most and calls == 3 * 4  # 3 steps, 4 layers (the root has none)
    assert vs_torch == 0.0 and vs_reference < 1e-6


class Experts(nn.Module):
    """Two experts; each sample goes to one by the sign of its first feature, so a rank
    whose samples all route one way leaves the other expert without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        to_a = x[:, 0] > 0
        routes = ((self.a, to_a), (self.b, ~to_a))
        parts = [expert(x[rows]) for expert, rows in routes if rows.any()]
        return torch.cat(parts)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Experts()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


def routed_batch(step: int, batch: int) -> torch.Tensor:
    """First half of the batch (rank 0's share at W=2) to expert a, second half to b."""
    x = feature_batch(step, batch)
    x[:, 0] = x[:, 0].abs() * torch.tensor([1.0] * (batch // 2) + [-1.0] * (batch - batch // 2))
    return x


def check_unused_params() -> tuple[float, float]:
    def wrap(model: nn.Module, shard: Shard) -> None:
        per_block(model, shard)
        model.set_reduce_scatter_unused_params(True)

    return train_and_compare(Routed, lambda m, x: m(x).pow(2).mean(), routed_batch, wrap=wrap,
                             shard_fns=versus_torch("set_reduce_scatter_unused_params"))


def test_unused_params_reduce_zeros_where_ranks_route_differently(ranks):
    """Rank 0 uses only expert a, rank 1 only b: both still reduce both, the average
    counting the other rank's zero, which is single-process training."""
    vs_reference, vs_torch = ranks.run(check_unused_params, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6


class RoutedAfterLinear(nn.Module):
    """A linear unit, then the experts unit routing by the sign of the input's first feature."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), Experts()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x), route=x[:, 0])


class RoutedExperts(Experts):
    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.cat([route[:, None], x[:, 1:]], dim=1))


def mixed_then_one_way(step: int, batch: int) -> torch.Tensor:
    """Rank 0's share (at W=2) routes to both experts, rank 1's only to expert b."""
    x = feature_batch(step, batch)
    signs = [1.0, -1.0] * (batch // 4) + [-1.0] * (batch - 2 * (batch // 4))
    x[:, 0] = x[:, 0].abs() * torch.tensor(signs)
    return x


def check_unused_params_on_one_rank() -> tuple[float, float]:
    def make_model() -> nn.Module:
        model = RoutedAfterLinear()
        model.layers[1] = RoutedExperts()
        return model

    def wrap(model: nn.Module, shard: Shard) -> None:
        per_block(model, shard)
        model.set_reduce_scatter_unused_params(True)

    return train_and_compare(make_model, lambda m, x: m(x).pow(2).mean(), mixed_then_one_way,
                             wrap=wrap, shard_fns=versus_torch("set_reduce_scatter_unused_params"))


def test_unused_params_on_one_rank_keep_the_reduction_order(ranks):
    """The experts unit has every gradient on rank 0 and one expert's only on rank 1: it
    still reduces at the same point of the backward on both (after its input's gradient),
    so the ranks issue their collectives in one order."""
    vs_reference, vs_torch = ranks.run(check_unused_params_on_one_rank, world_size=2)[0]
    assert vs_torch == 0.0 and vs_reference < 1e-6


def check_all_reduce_hook(own_stream: bool) -> tuple[float, float, int]:
    """A summed reduction the hook averages, on ours and torch's; with `own_stream` the hook
    gets a stream of its own (torch.cpu.Stream here: on the CPU every stream is the one
    thread), and a non-stream is refused."""
    with pytest.raises(TypeError, match="set_all_reduce_hook: stream must be a torch.Stream"):
        fully_shard(MLP()).set_all_reduce_hook(lambda t: None, stream=object())
    calls = [0]
    stream = torch.cpu.Stream() if own_stream else None

    def halve(reduced: torch.Tensor) -> None:
        calls[0] += 1
        reduced.div_(dist.get_world_size())

    def wrap(model: nn.Module, shard: Shard) -> None:
        per_block(model, shard)
        for module in annotated(model):
            module.set_force_sum_reduction_for_comms(True)  # sum on the wire,
            module.set_gradient_divide_factor(1.0)  # divided by 1: the hook averages
            module.set_all_reduce_hook(halve, stream=stream)

    errors = train_and_compare(MLP, mse_loss, feature_batch, wrap=wrap)
    return (*errors, calls[0])


@pytest.mark.parametrize("own_stream", [False, True], ids=["current stream", "own stream"])
def test_all_reduce_hook_runs_on_every_reduction(ranks, own_stream):
    vs_reference, vs_torch, calls = ranks.run(check_all_reduce_hook, own_stream=own_stream,
                                              world_size=2)[0]
    assert calls == 2 * 3 * 4  # ours and torch's, 3 steps, 4 layers
    assert vs_torch == 0.0 and vs_reference < 1e-6


def check_separate_group() -> tuple[float, float, bool]:
    units = []

    def wrap(model: nn.Module, shard: Shard) -> None:
        per_block(model, shard)
        model.set_separate_reduce_scatter_group()
        units.append(model.layers[0]._state().unit if hasattr(model, "_state") else None)

    shard_fns = versus_torch("set_separate_reduce_scatter_group")
    errors = train_and_compare(MLP, mse_loss, feature_batch, wrap=wrap, shard_fns=shard_fns)
    (part,) = units[0].parts
    group = part.mesh.shard_group
    separate = part.reduce_group is not group and dist.get_process_group_ranks(
        part.reduce_group
    ) == dist.get_process_group_ranks(group)
    return (*errors, separate)


def test_separate_reduce_scatter_group(ranks):
    vs_reference, vs_torch, separate = ranks.run(check_separate_group, world_size=2)[0]
    assert separate
    assert vs_torch == 0.0 and vs_reference < 1e-6


class RecordingEvent:
    """Stands in for a torch.Event (CPU has none): records when it is waited for."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self, stream=None) -> None:
        self.log.append("event")


def check_post_optim_event() -> list[str]:
    log: list[str] = []
    model = MLP()
    per_block(model, fully_shard)

    def gather(output, input, group, async_op=False):
        log.append("gather")
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)

    for module in annotated(model):
        module.set_custom_all_gather(gather)
    x = feature_batch(0, 2)
    mse_loss(model, x).backward()
    log.clear()
    model.set_post_optim_event(RecordingEvent(log))
    mse_loss(model, x).backward()
    mse_loss(model, x).backward()  # no new event: nothing waited
    with pytest.raises(TypeError, match="set_post_optim_event: expected a torch.Event, got int"):
        model.set_post_optim_event(1)
    # What torch.get_device_module("cpu").current_stream().record_event() returns: nothing
    # to wait for.
    cpu_event = torch.get_device_module("cpu").current_stream().record_event()
    model.set_post_optim_event(cpu_event)
    mse_loss(model, x).backward()
    assert cpu_event is None
    return log


def test_post_optim_event_is_waited_once_before_the_next_gathers(ranks):
    log = ranks.run(check_post_optim_event, world_size=2)[0]
    assert log[0] == "event" and log.count("event") == 1
    assert log[1:] == ["gather"] * (len(log) - 1)


def check_share_comm_ctx() -> tuple[bool, int]:
    first, second = MLP(), MLP(dims=(1, 8))
    per_block(first, fully_shard)
    per_block(second, fully_shard)
    share_comm_ctx([first, second])
    first.set_max_all_gathers_in_flight(1)
    x = feature_batch(0, 2)
    second(first(x)).sum().backward()
    shared = all(m._state().comm is first._state().comm for m in annotated(second))
    return shared, second.layers[0]._state().comm.settings.max_all_gathers_in_flight


def test_share_comm_ctx_shares_one_context_between_roots(ranks):
    shared, limit = ranks.run(check_share_comm_ctx, world_size=2)[0]
    assert shared and limit == 1
