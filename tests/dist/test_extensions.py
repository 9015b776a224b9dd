"""torch's fully_shard all-gather extension contract (fsdp_pre_all_gather /
fsdp_post_all_gather on a parameter's local shard): torchao's quantized training trains
step for step as under torch's fully_shard, the parameters keep their subclass, the hooks
are called as torch 2.13 calls them (mesh, outer size and stride, module, policy; out=
from the second gather on; the shard mesh under HSDP), hooks attached to a local shard
after annotation are used, and a subclass without hooks is refused at its first gather."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from tests.dist.parity import make_mesh, max_diff, rank_share

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchao = pytest.importorskip("torchao")
    from torchao.prototype.quantized_training import (
        bitnet_training,
        int8_mixed_precision_training,
    )


def quantized_mlp(config: object) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 4)
    )
    torchao.quantize_(model, config)
    return model


def plain(t: torch.Tensor) -> torch.Tensor:
    """The values of a torchao training weight (or a plain tensor)."""
    return getattr(t, "_data", t)


def check_torchao_like_torch(recipe: str, bf16: bool = False) -> dict[str, object]:
    config = {"bitnet": bitnet_training, "int8": int8_mixed_precision_training}[recipe]()
    models = [quantized_mlp(config), quantized_mlp(config)]
    # With bf16 the hooks get the policy and cast what they send (torchao's int8 does).
    policies: list[dict[str, object]] = [{}, {}]
    if bf16:
        policies = [{"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
                    {"mp_policy": TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16)}]
    for model, shard, policy in zip(models, (fully_shard, torch_fully_shard), policies):
        for i in (0, 2):
            shard(model[i], mesh=make_mesh(), **policy)
        shard(model, mesh=make_mesh(), **policy)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    losses, loss_diff, param_diff = [], 0.0, 0.0
    for step in range(4):
        torch.manual_seed(100 + step)
        x = rank_share(torch.randn(8, 16))
        pair = [(m(x) - 1).pow(2).mean() for m in models]
        for loss, optim in zip(pair, optims):
            loss.backward()
            optim.step()
            optim.zero_grad()
        losses.append(pair[0].item())
        loss_diff = max(loss_diff, max_diff(*pair))
        for (_, ours), theirs in zip(models[0].named_parameters(), models[1].parameters()):
            param_diff = max(param_diff, max_diff(plain(ours.to_local()), plain(theirs.to_local())))
    weight = models[0][0].weight
    return {
        "losses": losses, "loss_diff": loss_diff, "param_diff": param_diff,
        "shard_class": type(weight.to_local()).__name__, "param_class": type(weight).__name__,
    }


@pytest.mark.parametrize("recipe, bf16", [("bitnet", False), ("int8", False), ("int8", True)])
def test_torchao_quantized_training_like_torch(ranks, recipe, bf16):
    for result in ranks.run(check_torchao_like_torch, recipe=recipe, bf16=bf16, world_size=2):
        assert result["loss_diff"] == 0.0 and result["param_diff"] == 0.0, result
        expected = {
            "bitnet": "BitNetTrainingLinearWeight", "int8": "Int8MixedPrecisionTrainingLinearWeight"
        }
        assert result["shard_class"] == expected[recipe], result
        assert result["param_class"] == "DTensor"
        assert result["losses"][-1] < result["losses"][0]


def check_bitnet_is_not_full_precision() -> tuple[float, float]:
    """The same model without quantization computes another loss: the extension matters."""
    losses = []
    for config in (bitnet_training(), None):
        model = quantized_mlp(config) if config is not None else _plain_mlp()
        fully_shard(model, mesh=make_mesh())
        torch.manual_seed(100)
        losses.append((model(rank_share(torch.randn(8, 16))) - 1).pow(2).mean().item())
    return losses[0], losses[1]


def _plain_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 4))


def test_quantization_is_kept(ranks):
    for quantized, full_precision in ranks.run(check_bitnet_is_not_full_precision, world_size=2):
        assert abs(quantized - full_precision) > 1e-4


class Recorded:
    """What the hooks saw, on this rank."""

    calls: list[tuple[object, ...]] = []


def pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    """Send the shard in bfloat16 and its row sums in float32, with metadata."""
    Recorded.calls.append((
        "pre", mesh.ndim, mesh.size(), tuple(outer_size), tuple(outer_stride),
        type(module).__name__,
    ))
    return (self.to(torch.bfloat16), self.sum(dim=-1)), {"rows": self.shape[0]}


def post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
    low, sums = outputs
    Recorded.calls.append(
        ("post", metadata["rows"], param_dtype, out is not None, tuple(low.shape))
    )
    assert torch.allclose(low.float().sum(dim=-1), sums, atol=0.05)  # both inputs arrived
    if out is not None:
        with torch.autograd._unsafe_preserve_version_counter(out):
            out.copy_(low)
        return None
    up = low.to(param_dtype)
    return up, (up,)


def check_hooks_attached_after_to_empty(mesh_shape: tuple[int, ...]) -> dict[str, object]:
    """Hooks attached to the plain local shards after fully_shard and to_empty are called
    as torch calls them, and the model computes with the bfloat16-rounded weights they
    gather: losses and gradients of a reference whose weights are rounded alike."""
    Recorded.calls = []
    shards = mesh_shape[-1]
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Linear(4, 2, bias=False))
    with torch.device("meta"):
        ours = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Linear(4, 2, bias=False))
    fully_shard(ours, mesh=make_mesh(mesh_shape))
    ours.to_empty(device="cpu")
    with torch.no_grad():
        for p, r in zip(ours.parameters(), ref.parameters()):
            p.to_local().copy_(r.chunk(shards)[dist.get_rank() % shards])
            local = p._local_tensor
            local.fsdp_pre_all_gather = pre_all_gather.__get__(local)
            local.fsdp_post_all_gather = post_all_gather.__get__(local)
        for r in ref.parameters():
            r.copy_(r.to(torch.bfloat16).float())
    x = torch.randn(4, 6)
    loss_diff = grad_diff = 0.0
    for _ in range(2):
        loss, ref_loss = ours(x).sum(), ref(x).sum()
        loss.backward()
        ref_loss.backward()
        loss_diff = max(loss_diff, abs(loss.item() - ref_loss.item()))
        for p, r in zip(ours.parameters(), ref.parameters()):
            grad_diff = max(grad_diff, max_diff(p.grad.full_tensor(), r.grad))
    return {"calls": Recorded.calls, "loss_diff": loss_diff, "grad_diff": grad_diff}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["FSDP", "HSDP"])
def test_hooks_attached_to_a_local_shard(ranks, mesh_shape):
    world = 4 if len(mesh_shape) == 2 else 2
    check = check_hooks_attached_after_to_empty
    for result in ranks.run(check, mesh_shape=mesh_shape, world_size=world):
        calls = result["calls"]
        # Per iteration one gather of both weights (the root keeps them for backward).
        assert [c[0] for c in calls] == ["pre", "pre", "post", "post"] * 2, calls
        # The 1-D shard mesh (under HSDP too), the unsharded size and stride, the owner.
        assert calls[0] == ("pre", 1, 2, (4, 6), (6, 1), "Linear")
        assert calls[1] == ("pre", 1, 2, (2, 4), (4, 1), "Linear")
        # Metadata back; out= from the second gather on; outputs gathered on dim 0.
        assert calls[2] == ("post", 2, torch.float32, False, (4, 6))
        assert all(c[3] for c in calls[4:] if c[0] == "post")
        assert result["loss_diff"] < 1e-6 and result["grad_diff"] < 1e-6, result


def check_subclass_without_hooks_refused() -> str:
    """Hooks may be attached to a shard after fully_shard (torch allows it): a subclass
    still without them is refused at its first gather, before any collective."""
    from torch.testing._internal.two_tensor import TwoTensor

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(TwoTensor(model.weight.detach(), model.weight.detach().clone()))
    fully_shard(model, mesh=make_mesh())
    assert isinstance(model.weight._local_tensor, TwoTensor)  # carried into the shard
    with pytest.raises(TypeError) as raised:
        model(torch.randn(2, 4))
    return str(raised.value)


def test_subclass_without_hooks_is_refused(ranks):
    messages = ranks.run(check_subclass_without_hooks_refused, world_size=2)
    assert messages[0] == messages[1]  # every rank alike
    assert "parameter 'weight' is a TwoTensor" in messages[0]
    assert "fsdp_pre_all_gather" in messages[0]
    assert "attach them to the parameter's local shard before its first gather" in messages[0]


def _pair_class() -> type:
    """TwoTensor (torch's test subclass: a pair of tensors computing as the first) with the
    one-argument hooks of torch's own extension test: both halves are gathered."""
    from torch.testing._internal.two_tensor import TwoTensor

    class Pair(TwoTensor):
        def fsdp_pre_all_gather(self, mesh):
            return (self.a, self.b), None

        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            a, b = outputs
            if out is not None:
                return None  # views of the outputs, which the gather refilled
            return Pair(a, b).to(param_dtype), (a, b)

    return Pair


def check_own_subclass_like_torch() -> tuple[float, float, str]:
    pair = _pair_class()

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.ReLU(), nn.Linear(6, 4, bias=False))
        for i in (0, 2):
            w = model[i].weight.detach()
            model[i].weight = nn.Parameter(pair(w, w.clone()))
        return model

    models = [make(), make()]
    for model, shard in zip(models, (fully_shard, torch_fully_shard)):
        shard(model[0], mesh=make_mesh())
        shard(model, mesh=make_mesh())
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    loss_diff = param_diff = 0.0
    for step in range(3):
        torch.manual_seed(step)
        x = rank_share(torch.randn(4, 8))
        losses = [m(x).pow(2).sum() for m in models]
        for loss, optim in zip(losses, optims):
            loss.backward()
            optim.step()
            optim.zero_grad()
        loss_diff = max(loss_diff, max_diff(*losses))
        for ours, theirs in zip(models[0].parameters(), models[1].parameters()):
            a, b = ours.to_local(), theirs.to_local()
            param_diff = max(param_diff, max_diff(a.a, b.a), max_diff(a.b, b.b))
    return loss_diff, param_diff, type(models[0][0].weight.to_local()).__name__


def test_own_subclass_like_torch(ranks):
    results = ranks.run(check_own_subclass_like_torch, world_size=2)
    for loss_diff, param_diff, shard_class in results:
        assert loss_diff == 0.0 and param_diff == 0.0
        assert shard_class == "Pair"


def check_plain_parameter_beside_a_hooked_one() -> float:
    """A unit whose first weight gathers through hooks and whose larger second weight
    gathers plainly: the plain one computes with its own values (its unsharded storage sized
    for it), the hooked one with its bfloat16 rounding."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 2, bias=False), nn.Linear(2, 8, bias=False))
    ours = copy.deepcopy(ref)
    fully_shard(ours, mesh=make_mesh())
    local = ours[0].weight._local_tensor
    local.fsdp_pre_all_gather = pre_all_gather.__get__(local)
    local.fsdp_post_all_gather = post_all_gather.__get__(local)
    with torch.no_grad():
        ref[0].weight.copy_(ref[0].weight.to(torch.bfloat16).float())
    x = torch.randn(3, 6)
    return max_diff(ours(x), ref(x))


def test_plain_parameter_beside_a_hooked_one(ranks):
    assert ranks.run(check_plain_parameter_beside_a_hooked_one) == [0.0, 0.0]
