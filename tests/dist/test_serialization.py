"""The sharded parameters are ordinary tensors to torch's serialization: torch.save, pickle and
copy.deepcopy of `state_dict()`, of DCP's `get_model_state_dict` and of the optimizer's state
dict work for every layout, as on FSDP2, and what they saved loads back equal."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_compose import CPUOffloadPolicy, fully_shard
from tests.dist.parity import full, optimizer_step, per_block, rank_share, three_models
from tests.dist.test_tensor_parallel import TPModel, two_d
from tests.models import Transformer, lm_loss, mse_loss, token_batch


class MixedDtypes(nn.Module):
    """A frozen bfloat16 weight beside float32 ones, in one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(5, 5).to(torch.bfloat16).requires_grad_(False)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(x.to(torch.bfloat16)).float())


def round_trips(state: dict) -> dict[str, list]:
    """Each way of copying `state`, and whether every tensor came back equal (whole)."""
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    copies = {"torch.save": torch.load(saved, weights_only=False),
              "pickle": pickle.loads(pickle.dumps(state)), "deepcopy": copy.deepcopy(state)}
    return {how: [k for k, v in state.items()
                  if not isinstance(v, torch.Tensor) or not torch.equal(full(v), full(back[k]))]
            for how, back in copies.items()}


def trained(layout: str) -> tuple[nn.Module, nn.Module, list[torch.optim.Optimizer]]:
    """Ours and FSDP2's `layout` model after one AdamW step."""
    if layout == "tensor parallel":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        ref = TPModel()
        models = [
            two_d(copy.deepcopy(ref), mesh, shard) for shard in (fully_shard, torch_fully_shard)
        ]
        ours, theirs = models
        loss_fn, batch = mse_loss, torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1))
    else:
        make, kwargs, loss_fn = {
            "even and uneven rows": (Transformer, {}, lm_loss),
            "tied across units": (lambda: Transformer(tie_weights=True), {}, lm_loss),
            "CPU offload": (Transformer, {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
                            lm_loss),
            "mixed dtypes": (MixedDtypes, {}, mse_loss),
        }[layout]
        wrap = per_block if layout != "mixed dtypes" else (lambda m, shard, **kw: shard(m, **kw))
        _, ours, theirs = three_models(make, wrap=wrap, **kwargs)
        batch = token_batch(0, 4) if loss_fn is lm_loss \
            else torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    optims = [torch.optim.AdamW((p for p in m.parameters() if p.requires_grad), lr=1e-2)
              for m in (ours, theirs)]
    for model in (ours, theirs):
        share = batch if layout == "tensor parallel" else rank_share(batch)
        loss_fn(model, share).backward()
    optimizer_step(optims)
    return ours, theirs, optims


def check_serialization(layout: str) -> dict[str, object]:
    ours, theirs, optims = trained(layout)
    theirs_state = theirs.state_dict()
    out: dict[str, object] = {"vs_torch": max(
        float((full(v).double() - full(theirs_state[k]).double()).abs().max())
        for k, v in ours.state_dict().items())}
    for who, model, optim in (("ours", ours, optims[0]), ("fsdp2", theirs, optims[1])):
        out[who] = {
            "state_dict()": round_trips(model.state_dict()),
            "get_model_state_dict": round_trips(get_model_state_dict(model)),
            "optimizer": round_trips(
                {f"{i}.{k}": v for i, s in optim.state_dict()["state"].items()
                 for k, v in s.items()}),
        }
    return out


LAYOUTS = ["even and uneven rows", "tied across units", "CPU offload", "mixed dtypes",
           "tensor parallel"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_dicts_save_pickle_and_deepcopy_as_on_fsdp2(ranks, layout):
    world = 4 if layout == "tensor parallel" else 2
    for result in ranks.run(check_serialization, layout=layout, world_size=world):
        assert result["ours"] == result["fsdp2"] and result["vs_torch"] == 0.0, result
        assert all(bad == [] for ways in result["ours"].values() for bad in ways.values()), result


def check_one_rank_save_and_load() -> bool:
    """torch.save of the state dict at one rank; loaded into a fresh sharded model, equal."""
    torch.manual_seed(0)
    model = Transformer()
    per_block(model, fully_shard)
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    saved.seek(0)
    torch.manual_seed(1)
    fresh = Transformer()
    per_block(fresh, fully_shard)
    fresh.load_state_dict(torch.load(saved, weights_only=False))
    return all(
        torch.equal(full(a), full(b)) for a, b in zip(model.parameters(), fresh.parameters())
    )


def test_a_state_dict_saved_at_one_rank_loads_back(ranks):
    assert ranks.run(check_one_rank_save_and_load, world_size=1) == [True]
