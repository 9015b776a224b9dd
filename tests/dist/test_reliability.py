"""Unusual but legal use trains right, and misuse fails on every rank with an error that
names the module or parameter and the fix, before any collective: parameters replaced
after annotation, meta-device models watched by torch's MemTracker, meta parameters
unsharded by hand, meshes on a device this torch lacks, containers without forward,
reset_iter_state off the root, non-contiguous parameters."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_compose import fully_shard, load_checkpoint, save_checkpoint
from tests.dist.parity import assert_close_to, backward, full, optimizer_step, per_block
from tests.models import MLP, feature_batch, mse_loss

TIMEOUT_S = 120  # every case fails rather than hangs


def adamw(*models: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]


def check_parameter_replaced_after_annotation() -> float:
    """The optimizer is built once, before the replacement: the replacement's values go into
    the sharded parameter it holds, so it trains on them, as an in-place copy does."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    per_block(model, fully_shard)
    optims = adamw(ref, model)
    backward((ref, model), feature_batch(0, 2 * world), mse_loss)
    optimizer_step(optims)

    new_bias = torch.randn(5)
    with torch.no_grad():
        ref.layers[1].bias.copy_(new_bias)
    replacement = nn.Parameter(new_bias.clone())
    model.layers[1].bias = replacement
    with pytest.warns(UserWarning, match=r"parameter 'layers\.1\.bias' was replaced after "
                      r"fully_shard by a new tensor\. Its values were copied into the model's "
                      r"sharded parameter"):
        backward((ref, model), feature_batch(1, 2 * world), mse_loss)
    assert isinstance(model.layers[1].bias, DTensor) and model.layers[1].bias is not replacement
    optimizer_step(optims)
    for step in (2, 3):
        backward((ref, model), feature_batch(step, 2 * world), mse_loss)
        optimizer_step(optims)
    moved = (full(model.layers[1].bias) - new_bias).abs().max().item()
    assert moved > 1e-3, "the replaced parameter did not train"
    with pytest.raises(RuntimeError, match=r"SGD holds the tensor assigned to parameter "
                       r"'layers\.1\.bias' after fully_shard.*stepping it would change nothing"):
        torch.optim.SGD([replacement], lr=0.1).step()
    return assert_close_to(model, ref, where="after replacing layers.1.bias")


def test_parameter_replaced_after_annotation_trains(ranks):
    errors = ranks.run(check_parameter_replaced_after_annotation, world_size=2, timeout=TIMEOUT_S)
    assert max(errors) < 1e-6


def check_meta_init_under_mem_tracker() -> tuple[float, int]:
    """meta init -> fully_shard -> to_empty -> weights -> MemTracker -> train: the tracker
    holds weak references to the parameters when the first forward takes the shards."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = MLP()
    with torch.device("meta"):
        model = MLP()
    per_block(model, fully_shard)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())  # whole tensors, cut into this rank's shards
    optims = adamw(ref, model)
    tracker = MemTracker()
    tracker.track_external(model, optims[1])
    for step in range(3):
        with tracker:
            backward((ref, model), feature_batch(step, 2 * world), mse_loss)
            optimizer_step(optims)
        tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return assert_close_to(model, ref, where="under MemTracker"), peak["Total"]


def test_meta_init_trains_under_torch_mem_tracker(ranks):
    results = ranks.run(check_meta_init_under_mem_tracker, world_size=2, timeout=TIMEOUT_S)
    assert max(error for error, _ in results) < 1e-6
    assert min(peak for _, peak in results) > 0  # the tracker saw the step's memory


def check_meta_parameters_refused_before_gathering() -> None:
    with torch.device("meta"):
        model = MLP()
    per_block(model, fully_shard)
    with pytest.raises(RuntimeError, match=r"unit Linear on rank \d: parameters still on "
                       r"the meta device: \[weight, bias\]\. Initialise them"):
        model.layers[1].unshard()  # explicit, before any forward: a local check, no gather
    with pytest.raises(RuntimeError, match=r"unit layers\.0 on rank \d: parameters still on the "
                       r"meta device: \[layers\.0\.weight, layers\.0\.bias\]"):
        model(torch.ones(2, 8))


def test_meta_parameters_refused_before_gathering(ranks):
    ranks.run(check_meta_parameters_refused_before_gathering, world_size=2, timeout=TIMEOUT_S)


def check_mesh_on_a_missing_device() -> None:
    local_rank = os.environ.pop("LOCAL_RANK", None)  # else the mesh sets the missing device
    try:
        mesh = DeviceMesh("cuda", list(range(dist.get_world_size())))
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank
    model = MLP()
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\): the mesh is on device type "
                       r"'cuda', which this torch build or machine does not have"):
        fully_shard(model.layers[0], mesh=mesh)
    assert not isinstance(model.layers[0].weight, DTensor)  # untouched


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA devices")
def test_mesh_on_a_missing_device_is_refused(ranks):
    ranks.run(check_mesh_on_a_missing_device, world_size=2, timeout=TIMEOUT_S)


class Stack(nn.ModuleList):
    """A container that defines forward: an ordinary module to annotate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


def check_containers_without_forward() -> float:
    for container in (nn.ModuleList([nn.Linear(8, 8)]), nn.ModuleDict({"a": nn.Linear(8, 8)})):
        name = type(container).__name__
        with pytest.raises(ValueError, match=rf"fully_shard\({name}\): a container without "
                           r"forward is never called.*fully_shard\(list\(container\)\)"):
            fully_shard(container)
        assert not isinstance(next(container.parameters()), DTensor)  # untouched
    torch.manual_seed(0)
    ref = Stack([nn.Linear(8, 7), nn.Linear(7, 3)])
    stack = copy.deepcopy(ref)
    fully_shard(stack)
    backward((ref, stack), feature_batch(0, 2 * dist.get_world_size()), mse_loss)
    return assert_close_to(stack, ref, grads=True)


def test_containers_without_forward_are_refused(ranks):
    errors = ranks.run(check_containers_without_forward, world_size=2, timeout=TIMEOUT_S)
    assert max(errors) < 1e-6


def check_reset_iter_state_off_the_root() -> None:
    model = MLP()
    per_block(model, fully_shard)
    model.layers[1].reset_iter_state()  # before the first forward no unit is a root yet
    mse_loss(model, torch.ones(2, 8)).backward()
    with pytest.raises(RuntimeError, match=r"FSDPLinear\.reset_iter_state\(\): unit layers\.1 "
                       r"is not a root; call reset_iter_state on its root, FSDPMLP"):
        model.layers[1].reset_iter_state()
    model.reset_iter_state()


def test_reset_iter_state_off_the_root_is_refused(ranks):
    ranks.run(check_reset_iter_state_off_the_root, world_size=2, timeout=TIMEOUT_S)


class Transposed(nn.Module):
    """A layer whose weight is a transposed view: not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 7)
        self.weight = nn.Parameter(torch.randn(5, 7).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x)) @ self.weight


def check_non_contiguous_parameter(path: str) -> tuple[float, float, float]:
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = Transposed()
    assert not ref.weight.is_contiguous()
    model = copy.deepcopy(ref)
    fully_shard(model.inner)
    fully_shard(model)
    optims = adamw(ref, model)
    grads = 0.0
    for step in range(3):
        backward((ref, model), feature_batch(step, 2 * world), mse_loss)
        grads = max(grads, assert_close_to(model, ref, grads=True, where=f"step {step}"))
        optimizer_step(optims)
    params = assert_close_to(model, ref)
    state = {k: full(v) for k, v in model.state_dict().items()}
    assert list(state) == list(ref.state_dict())
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(
            state[key], value, msg=lambda m, key=key: f"state_dict {key}: {m}"
        )

    save_checkpoint(path, model, optims[1], step=3)
    torch.manual_seed(1)  # other values, replaced by the load
    restored = Transposed()
    fully_shard(restored.inner)
    fully_shard(restored)
    optim = adamw(restored)[0]
    assert load_checkpoint(path, restored, optim) == 3
    loaded = assert_close_to(restored, ref, where="after a checkpoint round trip")
    return grads, params, loaded


def test_non_contiguous_parameter_trains_like_single_process(ranks):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        results = ranks.run(check_non_contiguous_parameter, world_size=2, timeout=TIMEOUT_S,
                            path=path)
    assert max(max(r) for r in results) < 1e-6
