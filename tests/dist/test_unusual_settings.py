"""Settings that are legal but unusual train right or are refused on every rank, naming
both settings: mixed dtypes and tensor parallelism with reshard_after_forward=<int>, a
post-forward group on a dim of a larger mesh, sync_module_states with tensor parallelism,
set_post_optim_event off the root, a registered forward method that raises, meta
parameters whose peers never run forward, a root left unannotated, all-gather hooks
attached to a tensor subclass after fully_shard, and hooks run out of order."""

from __future__ import annotations

import copy
import datetime
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.two_tensor import TwoTensor

from fsdp_compose import (
    FSDPModule,
    UnmanagedParametersWarning,
    fully_shard,
    register_fsdp_forward_method,
)
from tests.dist.counting import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from tests.dist.parity import (
    assert_close_to,
    backward,
    max_diff,
    max_diff_to,
    optimizer_step,
    per_block,
    rank_share,
)
from tests.models import MLP, Transformer, feature_batch, lm_loss, mse_loss, token_batch


def messages_of(call) -> tuple[str, str]:
    """The type and message `call()` raised."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - any error is what the test compares
        return type(error).__name__, str(error)
    raise AssertionError(f"{call} raised nothing")


# -- mixed dtypes in a unit that reshards to a smaller group --------------------------------


class MixedBlock(nn.Module):
    """A float32 layer and a bfloat16 layer in one unit (odd sizes: uneven shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 7)
        self.second = nn.Linear(7, 8).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(torch.relu(self.first(x)).to(torch.bfloat16)).float()


def mixed_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(MixedBlock(), MixedBlock())


def check_mixed_dtypes_with_a_smaller_group() -> tuple[float, float, Counter]:
    """reshard_after_forward=2 at 4 ranks against True: the same numbers to the bit (only
    where backward gathers from differs), and close to the single-process model."""
    world = dist.get_world_size()
    ref = mixed_model()
    models = {value: copy.deepcopy(ref) for value in (2, True)}
    for value, model in models.items():
        for block in model:
            fully_shard(block, reshard_after_forward=value)
        fully_shard(model)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, *models.values())]
    vs_true = 0.0
    for step in range(3):
        losses = backward((ref, *models.values()), feature_batch(step, 2 * world), mse_loss)
        vs_true = max(vs_true, max_diff(losses[1], losses[2]))
        vs_true = max(vs_true, max_diff_to(models[2], models[True], grads=True))
        optimizer_step(optims)
        vs_true = max(vs_true, max_diff_to(models[2], models[True]))
    vs_ref = assert_close_to(models[2], ref, rtol=2e-2, atol=2e-2)
    loss = mse_loss(models[2], feature_batch(3, 2))
    with CollectiveCounter() as comms:
        loss.backward()
    return vs_true, vs_ref, comms.group_sizes


def test_mixed_dtypes_reshard_to_a_smaller_group(ranks):
    for vs_true, vs_ref, backward_sizes in ranks.run(
        check_mixed_dtypes_with_a_smaller_group, world_size=4
    ):
        assert vs_true == 0.0 and vs_ref < 2e-2
        # Both blocks gather in pairs in backward (the root, False, keeps its parameters).
        assert backward_sizes == {(ALL_GATHER, 2): 2, (REDUCE_SCATTER, 4): 2}


# -- tensor parallelism with a smaller post-forward group ------------------------------------


def tp_linear(mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})


def check_tensor_parallel_with_int_refused() -> list[tuple[str, str]]:
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    model = tp_linear(mesh)
    before = [(type(p), p.placements) for p in model.parameters()]
    at_annotation = messages_of(
        lambda: fully_shard(model, mesh=mesh["dp"], reshard_after_forward=2)
    )
    assert [(type(p), p.placements) for p in model.parameters()] == before  # untouched
    assert not isinstance(model, FSDPModule)
    fully_shard(model[0], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    by_setter = messages_of(lambda: model.set_reshard_after_forward(2))
    model.set_reshard_after_forward(4)  # the whole shard group: True, allowed
    mse_loss(model, feature_batch(0, 2)).backward()
    return [at_annotation, by_setter]


def test_tensor_parallel_with_a_smaller_post_forward_group_is_refused(ranks):
    results = ranks.run(check_tensor_parallel_with_int_refused, world_size=4)
    assert all(result == results[0] for result in results)  # every rank alike
    (kind, at_annotation), (_, by_setter) = results[0]
    assert kind == "NotImplementedError"
    assert at_annotation.startswith("fully_shard(Sequential): reshard_after_forward=<int>")
    assert "tensor-parallel parameter '0.weight'" in at_annotation
    assert by_setter.startswith(
        "FSDPSequential.set_reshard_after_forward: reshard_after_forward=<int>"
    )
    assert "pass reshard_after_forward=True or False" in by_setter


# -- a post-forward group on a dim of a larger mesh ------------------------------------------


def check_smaller_group_on_a_dim_of_a_larger_mesh() -> tuple[float, Counter]:
    """8 ranks, (dp 4, tp 2), blocks resharding to pairs of dp ranks: every rank builds
    every pair's group (it hung: each dp group built only its own). Plain parameters, so
    each tp rank is a data-parallel replica of its own: compared with True, to the bit."""
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    torch.manual_seed(0)
    models = {value: Transformer() for value in (2, True)}
    models[True].load_state_dict(models[2].state_dict())
    for value, model in models.items():
        per_block(
            model, lambda m, value=value, **kw: fully_shard(m, mesh=dp, reshard_after_forward=value)
        )
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models.values()]
    worst = 0.0
    share = token_batch(dist.get_rank() // 2, 2)  # each dp rank its own
    for _ in range(2):
        for model in models.values():
            lm_loss(model, share).backward()
        worst = max(worst, max_diff_to(models[2], models[True], grads=True))
        optimizer_step(optims)
    loss = lm_loss(models[2], share)
    with CollectiveCounter() as comms:
        loss.backward()
    return worst, comms.group_sizes


def test_smaller_group_on_a_dim_of_a_larger_mesh_does_not_hang(ranks):
    for worst, sizes in ranks.run(check_smaller_group_on_a_dim_of_a_larger_mesh, world_size=8):
        assert worst == 0.0
        assert sizes[(ALL_GATHER, 2)] == len(Transformer().blocks) + 1  # and the root
        assert set(sizes) == {(ALL_GATHER, 2), (REDUCE_SCATTER, 4)}


# -- sync_module_states with tensor parallelism -----------------------------------------------


def check_sync_module_states_with_tensor_parallel() -> list[float]:
    """Ranks start apart over dp (tp ranks agree: parallelize_module sends from tp rank 0).
    After sync_module_states, every rank's tp shard is its dp group's first rank's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    shards = [p.to_local().clone() for p in model.parameters()]
    everyone: list[list[torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shards)
    first = everyone[int(mesh["dp"].mesh[0])]  # (dp 0, this tp rank)
    assert rank < 2 or any(not torch.equal(a, b) for a, b in zip(shards, first))
    fully_shard(model[0], mesh=mesh["dp"], sync_module_states=True)
    fully_shard(model, mesh=mesh["dp"], sync_module_states=True)
    errors = []
    for param, expected in zip(model.parameters(), first):
        tp_shard = param.redistribute(placements=[Replicate(), param.placements[1]]).to_local()
        errors.append(max_diff(tp_shard, expected))
    return errors


def test_sync_module_states_with_tensor_parallel(ranks):
    for errors in ranks.run(check_sync_module_states_with_tensor_parallel, world_size=4):
        assert errors == [0.0] * 4


# -- set_post_optim_event on a unit that is not the root --------------------------------------


class RecordingEvent:
    """Stands for a torch.Event: records its waits."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self, stream=None) -> None:
        self.log.append(self.name)


def check_post_optim_event_off_the_root() -> list[str]:
    log: list[str] = []
    model = MLP()
    per_block(model, fully_shard)
    x = feature_batch(0, 2)
    model.layers[0].set_post_optim_event(RecordingEvent(log, "before lazy init"))
    mse_loss(model, x).backward()
    log.append("step")
    model.layers[1].set_post_optim_event(RecordingEvent(log, "after lazy init"))
    mse_loss(model, x).backward()
    log.append("step")
    mse_loss(model, x).backward()  # no new event: nothing waited
    return log


def test_post_optim_event_set_off_the_root_is_waited_once(ranks):
    for log in ranks.run(check_post_optim_event_off_the_root, world_size=2):
        assert log == ["before lazy init", "step", "after lazy init", "step"]


# -- a registered forward method that raises --------------------------------------------------


class Scorer(MLP):
    def score(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        out = self.forward(x).sum(dim=1)
        if fail:
            raise ValueError("scoring failed")
        return out


def check_registered_method_that_raises() -> tuple[bool, float]:
    """The failed call resets as a failed forward does: every unit resharded and idle,
    the next iteration trains like the single-process model."""
    torch.manual_seed(0)
    ref = Scorer()
    ours = copy.deepcopy(ref)
    per_block(ours, fully_shard)
    register_fsdp_forward_method(ours, "score")
    x = feature_batch(0, 2 * dist.get_world_size())
    with pytest.raises(ValueError, match="scoring failed"):
        ours.score(rank_share(x), fail=True)
    resharded = all(isinstance(p, DTensor) for p in ours.parameters())
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(2):
        backward((ref, ours), feature_batch(step, 2 * dist.get_world_size()),
                 lambda model, batch: model.score(batch).mean())
        optimizer_step(optims)
    return resharded, assert_close_to(ours, ref)


def test_registered_forward_method_that_raises_resets(ranks):
    for resharded, vs_reference in ranks.run(check_registered_method_that_raises, world_size=2):
        assert resharded and vs_reference < 1e-5


# -- meta parameters on a rank whose peers never run forward ---------------------------------


def check_meta_rank_alone() -> tuple[str, str] | None:
    """Rank 1 forgot to initialise; rank 0 never runs forward. Rank 1's check with the
    others times out, and its error says what it found, not only the wait."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    mesh = DeviceMesh.from_group(group, "cpu")
    result = None
    if dist.get_rank() == 1:
        with torch.device("meta"):
            model = MLP()
        per_block(model, lambda m, **kw: fully_shard(m, mesh=mesh))
        result = messages_of(lambda: model(feature_batch(0, 2)))
    dist.barrier()  # the default group: rank 0 waits here for rank 1's timeout
    return result


def test_meta_parameters_named_when_peers_never_run_forward(ranks):
    kind, message = ranks.run(check_meta_rank_alone, world_size=2)[1]
    assert kind == "RuntimeError"
    assert message.startswith("fsdp_compose: unit layers.0 on rank 1: parameters still on the "
                              "meta device: [layers.0.weight, layers.0.bias]")
    assert "materialize(model)" in message
    assert "model check with the other ranks, which then failed too" in message


# -- a root left unannotated ------------------------------------------------------------------


def check_unannotated_root() -> list[list[str]]:
    """One warning per model, at its first forward, naming exactly the parameters no unit
    manages; none for a fully annotated model or once the user filters it."""
    said = []
    for annotate_root, ignore in ((False, False), (True, False), (False, True)):
        torch.manual_seed(0)
        model = Transformer()
        for block in model.blocks:
            fully_shard(block)
        if annotate_root:
            fully_shard(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if ignore:
                warnings.filterwarnings("ignore", category=UnmanagedParametersWarning)
            for step in range(2):
                lm_loss(model, token_batch(step, 2)).backward()
        said.append([str(w.message) for w in caught if w.category is UnmanagedParametersWarning])
    assert not nn.modules.module._global_forward_pre_hooks  # nothing left for later steps
    return said


def test_unannotated_root_is_warned_of_once(ranks):
    blocks_only, annotated, filtered = ranks.run(check_unannotated_root, world_size=2)[0]
    assert annotated == [] and filtered == []
    assert len(blocks_only) == 1
    own = [n for n, _ in Transformer().named_parameters() if not n.startswith("blocks.")]
    assert f"its parameters {own} are in no unit" in blocks_only[0]
    assert blocks_only[0].startswith("fsdp_compose: Transformer holds fully_shard units")


# -- all-gather hooks attached to a tensor subclass after fully_shard ------------------------


def pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    Hooks.ran += 1
    return (self.to(torch.bfloat16),), None


@torch.no_grad()
def post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
    (tensor,) = outputs
    if out is not None:
        with torch.autograd._unsafe_preserve_version_counter(out):
            out.copy_(tensor)
        return None
    up = tensor.to(param_dtype)
    return up, (tensor, up)


class Hooks:
    ran = 0


def two_tensor_mlp() -> nn.Sequential:
    """torch's _init_two_tensor_mlp: weights that are TwoTensors, no bias."""
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(),
                                          nn.Linear(8, 8, bias=False)) for _ in range(3)))
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        weight = linear.weight.detach()
        linear.weight = nn.Parameter(TwoTensor(weight, weight.clone()))
    return model


def train_patched(shard) -> list[float]:
    """torch's test_all_gather_extensions_monkey_patch, on the CPU: annotate on meta,
    to_empty, initialise, attach the hooks to the weights' local shards, train. Returns
    the losses."""
    with torch.device("meta"):
        model = two_tensor_mlp()
    for mlp in model:
        shard(mlp)
    shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # the same values for both runtimes: whole, then this rank's shard
    world, rank = dist.get_world_size(), dist.get_rank()
    for param in model.parameters():
        local = param._local_tensor
        with torch.no_grad():
            local.copy_(nn.init.trunc_normal_(torch.empty(param.shape)).chunk(world)[rank])
        local.fsdp_pre_all_gather = pre_all_gather.__get__(local)
        local.fsdp_post_all_gather = post_all_gather.__get__(local)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(42 + dist.get_rank() + 1)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(2, 8)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def check_hooks_attached_to_a_subclass_after_fully_shard() -> tuple[list[float], list[float], int]:
    Hooks.ran = 0
    ours = train_patched(fully_shard)
    ran = Hooks.ran
    return ours, train_patched(torch_fully_shard), ran


def test_hooks_attached_to_a_subclass_after_fully_shard(ranks):
    for ours, theirs, ran in ranks.run(check_hooks_attached_to_a_subclass_after_fully_shard):
        assert ours == theirs and ran > 0


# -- hooks out of order ------------------------------------------------------------------------


def check_hooks_out_of_order_raise() -> str:
    """A forward that starts while the unit is in its backward (here: the phase set by hand,
    as a hook running out of order would leave it) raises, naming the move; under python -O
    too (a raise, not an assert)."""
    from fsdp_compose.schedule.phase import PRE_BACKWARD

    torch.manual_seed(0)
    model = MLP()
    per_block(model, fully_shard)
    mse_loss(model, feature_batch(0, 2)).backward()
    model.layers[0]._state().phase = PRE_BACKWARD
    return messages_of(lambda: model(feature_batch(1, 2)))[1]


def test_hooks_out_of_order_raise(ranks):
    message = ranks.run(check_hooks_out_of_order_raise, world_size=1)[0]
    assert message == (
        "fsdp_compose: unit layers.0 on rank 0 cannot go from PRE_BACKWARD to FORWARD: its "
        "hooks ran out of order."
    )
