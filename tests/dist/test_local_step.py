"""torch's elementwise optimizers step on the sharded parameters' local tensors (param/
local_step.py): bit for bit FSDP2's training and optimizer state, DTensors everywhere
outside the step, and the DTensor path kept for any other optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp_compose import fully_shard
from fsdp_compose.param.local_step import ELEMENTWISE
from tests.dist.parity import (
    backward, full, max_diff_to, optimizer_step, three_models, two_models,
)
from tests.models import Transformer, lm_loss, token_batch

VARIANTS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# Fused kernels DTensor has a sharding strategy for (fused SGD and Adagrad fail on FSDP2's
# parameters, and at the first step on ours, which runs on the DTensors).
FUSED = (torch.optim.Adam, torch.optim.AdamW)


def cases() -> list[tuple[str, str]]:
    return [(cls.__name__, variant) for cls in ELEMENTWISE for variant in VARIANTS
            if variant != "fused" or cls in FUSED]


def make_optimizer(name: str, variant: str, params) -> torch.optim.Optimizer:
    cls = getattr(torch.optim, name)
    extra = {"momentum": 0.9} if cls is torch.optim.SGD else {}
    return cls(params, lr=1e-2, weight_decay=0.01, **extra, **VARIANTS[variant])


def whole_state(optim: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    return [(f"{i}.{k}", full(v)) for i, s in enumerate(optim.state.values())
            for k, v in sorted(s.items()) if isinstance(v, torch.Tensor)]


def check_steps_like_fsdp2(name: str, variant: str) -> dict[str, object]:
    ref, ours, theirs = three_models(Transformer)
    optims = [make_optimizer(name, variant, m.parameters()) for m in (ours, theirs)]
    seen: list[set[type]] = []
    optims[0].register_step_pre_hook(
        lambda opt, args, kwargs: seen.append({type(p) for g in opt.param_groups for p in g["params"]})
    )
    world, vs_torch = dist.get_world_size(), 0.0
    for step in range(3):
        backward((ref, ours, theirs), token_batch(step, 2 * world), lm_loss)
        ref.zero_grad()
        optimizer_step(optims)
        vs_torch = max(vs_torch, max_diff_to(ours, theirs))
    ours_state, their_state = whole_state(optims[0]), whole_state(optims[1])
    assert [k for k, _ in ours_state] == [k for k, _ in their_state]
    state_diff = max((float((a.double() - b.double()).abs().max()) for (_, a), (_, b)
                      in zip(ours_state, their_state) if a.numel()), default=0.0)
    outside = {type(p) for g in optims[0].param_groups for p in g["params"]}
    state_types = {type(v) for s in optims[0].state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0}
    return {"vs_torch": vs_torch, "state": state_diff, "inside": seen, "outside": outside,
            "state_types": state_types}


@pytest.mark.parametrize(("name", "variant"), cases())
def test_an_elementwise_optimizer_steps_on_local_tensors_as_fsdp2_steps(ranks, name, variant):
    result = ranks.run(check_steps_like_fsdp2, name=name, variant=variant)[0]
    assert result["vs_torch"] == 0.0 and result["state"] == 0.0, result
    assert result["inside"][0] != {torch.Tensor}  # the first step: on DTensors
    assert all(types == {torch.Tensor} for types in result["inside"][1:]), result["inside"]
    assert result["outside"] == {torch.nn.Parameter} or all(
        issubclass(t, DTensor) for t in result["outside"]), result["outside"]
    assert result["state_types"] == {DTensor}


class ScaledAdamW(torch.optim.AdamW):
    """A user's optimizer: it may read the global shape, so it keeps the DTensors."""


def check_other_optimizers_keep_dtensors() -> list[set[type]]:
    _, ours = two_models(Transformer)
    optim = ScaledAdamW(ours.parameters(), lr=1e-2)
    seen: list[set[type]] = []
    optim.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append({type(p) for g in opt.param_groups for p in g["params"]})
    )
    for step in range(2):
        lm_loss(ours, token_batch(step, 2)).backward()
        optimizer_step([optim])
    return seen


def test_other_optimizers_step_on_dtensors(ranks):
    seen = ranks.run(check_other_optimizers_keep_dtensors)[0]
    assert len(seen) == 2 and all(torch.Tensor not in types for types in seen), seen


def check_a_failed_step_restores_the_dtensors() -> tuple[bool, float]:
    ref, ours, theirs = three_models(Transformer)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(2):
        backward((ref, ours, theirs), token_batch(step, 4), lm_loss)
        optimizer_step(optims)

    def fail(opt, args, kwargs):
        raise RuntimeError("a hook failed")

    handle = optims[0].register_step_pre_hook(fail)
    backward((ref, ours, theirs), token_batch(2, 4), lm_loss)
    with pytest.raises(RuntimeError, match="a hook failed"):
        optims[0].step()
    handle.remove()
    restored = all(isinstance(p, DTensor) for g in optims[0].param_groups for p in g["params"])
    restored = restored and all(isinstance(v, DTensor) for s in optims[0].state.values()
                                for v in s.values() if v.dim() > 0)
    optimizer_step(optims)
    return restored, max_diff_to(ours, theirs)


def test_a_failed_step_leaves_the_dtensors_in_place(ranks):
    restored, vs_torch = ranks.run(check_a_failed_step_restores_the_dtensors)[0]
    assert restored and vs_torch == 0.0


def trained(seed: int):
    """Ours and FSDP2's Transformer with AdamW after two steps on data seeded by `seed`."""
    _, ours, theirs = three_models(Transformer)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(2):
        batch = token_batch(seed + step, 4)
        for model in (ours, theirs):
            lm_loss(model, batch.chunk(dist.get_world_size())[dist.get_rank()]).backward()
        optimizer_step(optims)
    return (ours, theirs), optims


def check_save(path: str) -> None:
    models, optims = trained(seed=0)
    for name, model, optim in zip(("ours", "fsdp2"), models, optims):
        dcp.save(get_optimizer_state_dict(model, optim), checkpoint_id=f"{path}/{name}")


def check_load(path: str) -> dict[str, list]:
    """Both checkpoints loaded into ours (other values first), whole, as lists; then a step
    on each as FSDP2 steps."""
    loaded = {}
    models, optims = trained(seed=5)
    for name in ("ours", "fsdp2"):
        state = get_optimizer_state_dict(models[0], optims[0])
        dcp.load(state, checkpoint_id=f"{path}/{name}")
        set_optimizer_state_dict(models[0], optims[0], state)
        loaded[name] = [v.tolist() for _, v in whole_state(optims[0])]
    return loaded


def test_dcp_saved_at_2_ranks_loads_at_1_and_4_equal_to_fsdp2s(ranks, tmp_path):
    ranks.run(check_save, path=str(tmp_path), world_size=2)
    for world_size in (1, 4):
        loaded = ranks.run(check_load, path=str(tmp_path), world_size=world_size)[0]
        assert loaded["ours"] == loaded["fsdp2"], world_size


def check_a_closure_computes_the_gradients() -> tuple[float, bool]:
    """optimizer.step(closure), as Lightning steps: the closure's backward fills the
    DTensors' gradients, which the step on local tensors then reads."""
    _, ours, theirs = three_models(Transformer)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    world, rank = dist.get_world_size(), dist.get_rank()
    before = [full(p).clone() for p in ours.parameters()]
    for step in range(3):
        batch = token_batch(step, 2 * world).chunk(world)[rank]
        for model, optim in zip((ours, theirs), optims):
            def closure(model=model, optim=optim, batch=batch):
                optim.zero_grad()
                loss = lm_loss(model, batch)
                loss.backward()
                return loss
            optim.step(closure)
    moved = all(not torch.equal(a, full(p)) for a, p in zip(before, ours.parameters()))
    return max_diff_to(ours, theirs), moved and type(optims[0].step).__name__ == "_LocalStep"


def test_a_step_with_a_closure_trains_as_fsdp2(ranks):
    vs_torch, moved = ranks.run(check_a_closure_computes_the_gradients)[0]
    assert vs_torch == 0.0 and moved


def check_a_model_sharded_on_meta_steps_on_local_tensors() -> str:
    """Sharded on the meta device, then to_empty() (which swaps the parameters' contents
    with torch.utils.swap_tensors): its optimizer still steps on local tensors."""
    with torch.device("meta"):
        model = Transformer()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        with torch.no_grad():
            p.normal_(0, 0.02)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        lm_loss(model, token_batch(step, 2)).backward()
        optimizer_step([optim])
    return type(optim.step).__name__


def test_a_model_sharded_on_meta_steps_on_local_tensors(ranks):
    assert ranks.run(check_a_model_sharded_on_meta_steps_on_local_tensors)[0] == "_LocalStep"
