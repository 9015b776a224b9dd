"""iter_full_state_dict: every state dict entry once, whole, bit for bit what full_tensor()
gives, with one all-gather per unit and mesh (the per-tensor loop: one per tensor), for every
layout: uneven, dim-1 shards, mixed dtypes, tied, CPU offload, a codec, HSDP, tensor parallel;
cast to a dtype on request."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import (
    CPUOffloadPolicy,
    Int8RowCodec,
    fully_shard,
    iter_full_state_dict,
    load_full_state_dict,
)
from tests.dist.counting import ALL_GATHER, CollectiveCounter
from tests.dist.parity import make_mesh, per_block
from tests.dist.test_serialization import MixedDtypes
from tests.dist.test_tensor_parallel import TPModel, two_d
from tests.models import Transformer, lm_loss, token_batch


def build(layout: str) -> tuple[nn.Module, int]:
    """A trained model of `layout`, and the all-gathers one pass over its units takes."""
    torch.manual_seed(0)
    if layout == "tensor parallel":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = two_d(TPModel(), mesh, fully_shard)
        model(torch.randn(2, 3, 16)).sum().backward()
        return model, 3  # 3 units; TP parameters add their own below
    if layout == "torchao int8 training":  # tensor-subclass weights with all-gather hooks
        from tests.dist.test_extensions import int8_mixed_precision_training, quantized_mlp

        model = quantized_mlp(int8_mixed_precision_training())
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        model(torch.randn(2, 16)).sum().backward()
        return model, 0  # the subclasses gather themselves (full_tensor), counted apart
    if layout == "mixed dtypes":
        model = MixedDtypes()
        fully_shard(model)
        model(torch.randn(2, 5)).sum().backward()
        return model, 1
    kwargs: dict = {
        "HSDP": lambda: {"mesh": make_mesh((2, 2))},
        "CPU offload": lambda: {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
        "dim-1 shards": lambda: {
            "shard_placement_fn": lambda p: (
                Shard(1) if p.ndim == 2 and p.shape[1] % 4 == 0 else None
            )
        },
    }.get(layout, dict)()
    model = Transformer(tie_weights=layout == "tied")
    per_block(model, fully_shard, **kwargs)
    if layout == "codec":
        for block in model.blocks:
            block.set_all_gather_codec(Int8RowCodec())
    lm_loss(model, token_batch(0, 2)).backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()  # values no init would give
    return model, 3


class FunctionalGathers(TorchDispatchMode):
    """All-gathers DTensor sends (functional collectives, which CollectiveCounter does not see)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "all_gather" in func.name()
        return func(*args, **(kwargs or {}))


def gathers(run) -> int:
    with CollectiveCounter() as counter, FunctionalGathers() as functional:
        run()
    return counter.counts[ALL_GATHER] + functional.count


def check_iter_full_state_dict(layout: str) -> dict[str, object]:
    model, units = build(layout)
    expected = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v)
        for k, v in model.state_dict().items()
    }
    items: list = []
    count = gathers(lambda: items.extend(iter_full_state_dict(model)))
    names = [name for name, _ in items]
    # A tensor-parallel parameter sharded over its TP mesh is gathered there too (replicated: not).
    tp_params = sum(
        p.device_mesh.ndim == 2 and p.placements[-1].is_shard() for p in model.parameters()
    ) if layout == "tensor parallel" else 0
    cast = dict(iter_full_state_dict(model, dtype=torch.bfloat16))
    return {
        "names": sorted(names) == sorted(expected) and len(names) == len(set(names)),
        "bit for bit": [n for n, t in items if not (t.dtype == expected[n].dtype
                                                   and torch.equal(t, expected[n]))],
        "all-gathers": count, "expected all-gathers": units + tp_params,
        "cast": [n for n, t in cast.items() if t.is_floating_point() and (
            t.dtype != torch.bfloat16 or not torch.equal(t, expected[n].to(torch.bfloat16)))],
    }


LAYOUTS = ["even and uneven rows", "dim-1 shards", "mixed dtypes", "tied", "CPU offload", "codec",
           "HSDP", "tensor parallel", "torchao int8 training"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_entry_once_whole_and_exact_with_one_gather_per_unit(ranks, layout):
    world = 4 if layout in ("HSDP", "tensor parallel") else 2
    for result in ranks.run(check_iter_full_state_dict, layout=layout, world_size=world):
        assert result["names"] and result["bit for bit"] == [] and result["cast"] == [], result
        if layout != "torchao int8 training":
            assert result["all-gathers"] == result["expected all-gathers"], result


def check_against_a_loop_of_full_tensor() -> tuple[int, int, int]:
    model, _ = build("even and uneven rows")
    ours = gathers(lambda: list(iter_full_state_dict(model)))
    loop = gathers(lambda: [v.full_tensor() for v in model.state_dict().values()])
    return ours, loop, len(model.state_dict())


def test_one_all_gather_per_unit_where_full_tensor_takes_one_per_tensor(ranks):
    ours, loop, tensors = ranks.run(check_against_a_loop_of_full_tensor)[0]
    assert ours == 3 and loop == tensors


def check_loading_whole_tensors_from_another_model(layout: str) -> dict[str, object]:
    """A trained model's iter_full_state_dict into a fresh one of the same layout: equal; then
    tensors of a wrong shape, and a name missing: refused alike, nothing changed."""
    trained, _ = build(layout)
    torch.manual_seed(1)
    fresh, _ = build(layout)  # (the same seed: retrain it elsewhere first)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # other values, to be replaced
    load_full_state_dict(fresh, iter_full_state_dict(trained))
    after = dict(iter_full_state_dict(fresh))
    equal = all(torch.equal(after[k], v) for k, v in iter_full_state_dict(trained))
    before = {k: v.clone() for k, v in after.items()}
    bad = [(k, v[..., :1] if v.dim() else v) if i == 0 else (k, v)
           for i, (k, v) in enumerate(iter_full_state_dict(trained))][:-1]  # one cut, one gone
    with pytest.raises(ValueError) as raised:
        load_full_state_dict(fresh, bad)
    unchanged = all(torch.equal(v, before[k]) for k, v in iter_full_state_dict(fresh))
    return {"equal": equal, "unchanged": unchanged, "error": str(raised.value)}


@pytest.mark.parametrize("layout", ["even and uneven rows", "HSDP", "tensor parallel"])
def test_whole_tensors_load_into_a_sharded_model_and_a_mismatch_changes_nothing(ranks, layout):
    world = 4 if layout in ("HSDP", "tensor parallel") else 2
    check = check_loading_whole_tensors_from_another_model
    results = ranks.run(check, layout=layout, world_size=world)
    assert len({r["error"] for r in results}) == 1, results
    for result in results:
        assert result["equal"] and result["unchanged"], result
        assert "missing keys [" in result["error"] and "shape mismatches [" in result["error"]
