"""shard_placement_fn: parameters sharded on a dim other than 0 (Shard(1), Shard(-1), the
largest dim) train as with torch's fully_shard, bit for bit, and as single-process training;
their shards, gradients, state dicts and checkpoints carry the placement; what torch refuses
is refused here too, naming the parameter, before anything changes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import Shard

from fsdp_compose import clip_grad_norm_, fully_shard
from tests.dist.counting import ALL_GATHER, CollectiveCounter
from tests.dist.parity import (
    backward,
    full,
    make_mesh,
    max_diff_to,
    optimizer_step,
    three_models,
    train_and_compare,
    two_models,
)
from tests.models import MLP, Transformer, feature_batch, lm_loss, mse_loss, token_batch
from tests.torch_support import needs_shard_placement_result


def shard_dim_1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim > 1 else None


def shard_last(param: nn.Parameter) -> Shard:
    return Shard(-1)


def shard_largest(param: nn.Parameter) -> Shard:
    """torch's own test's rule: the largest dim (the first of equals)."""
    return Shard(max(range(param.ndim), key=lambda d: (param.shape[d], -d)))


PLACEMENT_FNS = {"dim 1": shard_dim_1, "last dim": shard_last, "largest dim": shard_largest}


def check_parity(name: str) -> tuple[float, float, dict[str, tuple[str, str]]]:
    fn = PLACEMENT_FNS[name]
    errors = train_and_compare(Transformer, lm_loss, token_batch, shard_placement_fn=fn)
    _, ours, theirs = three_models(Transformer, shard_placement_fn=fn)
    theirs_params = dict(theirs.named_parameters())
    placements = {
        fqn: (str(p.placements), str(theirs_params[fqn].placements))
        for fqn, p in ours.named_parameters()
        if p.to_local().shape != theirs_params[fqn].to_local().shape
        or p.placements != theirs_params[fqn].placements
    }
    return errors.vs_reference, errors.vs_torch, placements


@pytest.mark.parametrize("name", list(PLACEMENT_FNS))
def test_trains_like_torch_fully_shard(ranks, name):
    for vs_reference, vs_torch, differing in ranks.run(check_parity, name=name, world_size=2):
        assert vs_torch == 0.0, name
        assert vs_reference < 1e-4, name
        assert differing == {}, differing  # same placements and local shapes as torch's


def check_shards_sit_on_the_dim() -> dict[str, tuple[int, tuple[int, ...]]]:
    _, ours = two_models(Transformer, shard_placement_fn=shard_dim_1)
    return {
        fqn: (p.placements[0].dim, tuple(p.to_local().shape))
        for fqn, p in ours.named_parameters()
        if fqn in ("blocks.0.fc2.weight", "blocks.0.norm1.weight")
    }


def test_shard_and_its_local_shape(ranks):
    for shards in ranks.run(check_shards_sit_on_the_dim, world_size=2):
        # fc2 is Linear(36, 12): weight (12, 36), each rank holds 18 of its 36 columns.
        assert shards["blocks.0.fc2.weight"] == (1, (12, 18))
        assert shards["blocks.0.norm1.weight"] == (0, (6,))


def check_checkpoint_reshards(path: str) -> tuple[float, float]:
    """Saved sharded on dim 1, loaded into a model sharded on dim 0 (DCP reshards), and the
    other way round; then one more step of each agrees with torch's on the same loads."""
    _, on_dim_1 = two_models(Transformer, shard_placement_fn=shard_dim_1)
    _, on_dim_0 = two_models(Transformer)
    with torch.no_grad():
        for p in on_dim_1.parameters():
            p.mul_(1.5)  # different values from the fresh models it is loaded into
    dcp.save(on_dim_1.state_dict(), checkpoint_id=path)
    state = on_dim_0.state_dict()
    dcp.load(state, checkpoint_id=path)
    on_dim_0.load_state_dict(state)
    loaded = max_diff_to(on_dim_0, on_dim_1)
    backward([on_dim_1, on_dim_0], token_batch(0, 4), lm_loss, share=lambda b: b)
    return loaded, max_diff_to(on_dim_0, on_dim_1, grads=True)


def test_checkpoint_reshards_between_dims(ranks, tmp_path):
    for loaded, grads in ranks.run(check_checkpoint_reshards, path=str(tmp_path), world_size=2):
        assert loaded == 0.0
        assert grads < 1e-6


def check_clip_like_torch() -> tuple[float, float]:
    models = three_models(Transformer, shard_placement_fn=shard_dim_1)
    backward(models, token_batch(0, 4), lm_loss)
    _, ours, theirs = models
    norm = clip_grad_norm_(ours.parameters(), max_norm=0.1)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm=0.1)
    optimizer_step([torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)])
    return abs(full(norm).item() - full(their_norm).item()), max_diff_to(ours, theirs)


def test_clip_grad_norm_like_torch(ranks):
    for norm_diff, params_diff in ranks.run(check_clip_like_torch, world_size=2):
        assert norm_diff == 0.0 and params_diff == 0.0


def check_refusals() -> list[tuple[str, str, bool]]:
    """What torch's fully_shard refuses, refused before any change: each case's error type,
    message, and whether the model's parameters are still the original tensors."""
    cases = {
        "uneven dim 1": shard_last,  # MLP: Linear(7, 5).weight is (5, 7), 7 columns on 2 ranks
        "out of range": lambda p: Shard(2),
        "not a Shard": lambda p: "dim 1",
    }
    outcomes = []
    for fn in cases.values():
        model = MLP()
        before = [id(p) for p in model.parameters()]
        with pytest.raises((ValueError, NotImplementedError)) as raised:
            fully_shard(model.layers[1], shard_placement_fn=fn)
        unchanged = before == [id(p) for p in model.parameters()]
        outcomes.append((raised.type.__name__, str(raised.value), unchanged))
    return outcomes


def test_refused_like_torch_naming_the_parameter(ranks):
    uneven, out_of_range, not_a_shard = ranks.run(check_refusals, world_size=2)[0]
    assert uneven[0] == "NotImplementedError" and "'weight'" in uneven[1]
    assert "on dim 1 does not split evenly over 2" in uneven[1]
    assert out_of_range[0] == "ValueError" and "Shard(2), out of range" in out_of_range[1]
    assert not_a_shard[0] == "ValueError" and "returned 'dim 1'" in not_a_shard[1]
    assert uneven[2] and out_of_range[2] and not_a_shard[2]


def check_post_forward_group() -> tuple[float, float]:
    """reshard_after_forward=2 at 4 ranks keeps dim-1 pieces between forward and backward.
    (torch 2.13's fully_shard fails on this case in its copy-out, so the second model is
    ours resharding fully: the same arithmetic.)"""
    def fully_resharded(module: nn.Module, **kwargs: object) -> object:
        return fully_shard(module, **{**kwargs, "reshard_after_forward": True})

    errors = train_and_compare(
        Transformer, lm_loss, token_batch, reshard_after_forward=2,
        shard_placement_fn=shard_largest, shard_fns=(fully_shard, fully_resharded),
    )
    return errors.vs_reference, errors.vs_torch


def test_reshard_after_forward_to_a_smaller_group(ranks):
    for vs_reference, vs_full_reshard in ranks.run(check_post_forward_group, world_size=4):
        assert vs_full_reshard == 0.0
        assert vs_reference < 1e-4


def experts_on_their_own_mesh() -> Callable[[nn.Parameter], object]:
    """A shard_placement_fn putting each block's (36, 12) weights on a (2, 2) HSDP mesh of
    their own (MoE experts), the rest on the unit's mesh (torch's ShardPlacementResult)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    info = HSDPMeshInfo(make_mesh((2, 2)), shard_mesh_dim=1, replicate_mesh_dim=0)
    return lambda p: ShardPlacementResult(Shard(0), info) if p.shape == (36, 12) else None


def check_parameters_on_their_own_mesh(
    reshard_after_forward: bool | int,
) -> tuple[float, float, dict[int, int]]:
    """torch's MoE pattern: some parameters (here each block's (36, 12) weights) on an HSDP
    mesh of their own, the rest fully sharded over all 4 ranks: two all-gathers per unit,
    gradients averaged over all ranks either way."""
    experts_apart = experts_on_their_own_mesh()
    errors = train_and_compare(
        Transformer, lm_loss, token_batch, shard_placement_fn=experts_apart,
        reshard_after_forward=reshard_after_forward,
    )
    _, ours, _ = three_models(Transformer, shard_placement_fn=experts_apart)
    with CollectiveCounter() as counter:
        ours.blocks[0].unshard()
    sizes = {size: n for (name, size), n in counter.group_sizes.items() if name == ALL_GATHER}
    return errors.vs_reference, errors.vs_torch, sizes


@needs_shard_placement_result
@pytest.mark.parametrize("reshard_after_forward", [True, 2])  # 2: pairs of ranks keep pieces
def test_parameters_on_their_own_mesh(ranks, reshard_after_forward):
    for vs_reference, vs_torch, gathers in ranks.run(
        check_parameters_on_their_own_mesh, reshard_after_forward=reshard_after_forward,
        world_size=4,
    ):
        assert vs_torch == 0.0
        assert vs_reference < 1e-4
        assert gathers == {4: 1, 2: 1}  # a block: one all-gather over 4 ranks, one over 2


def trained_on_dim_1(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The Transformer sharded on dim 1 over every rank, after two AdamW steps on data
    seeded by `seed` (the same whole batch at any world size)."""
    _, model = two_models(Transformer, shard_placement_fn=shard_dim_1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        lm_loss(model, token_batch(seed + step, 4)).backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def whole_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, list]:
    """Parameters and AdamW moments, whole, as lists (they travel through the result queue)."""
    state = {f"param {fqn}": full(p) for fqn, p in model.named_parameters()}
    for fqn, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{key} {fqn}"] = full(optim.state[p][key])
    return {key: value.tolist() for key, value in state.items()}


def check_save_on_dim_1(path: str) -> dict[str, list]:
    model, optim = trained_on_dim_1(seed=0)
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=path)
    return whole_state(model, optim)


def check_load_on_dim_1(path: str) -> dict[str, list]:
    model, optim = trained_on_dim_1(seed=7)  # other values, and optimizer state to load into
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    return whole_state(model, optim)


def test_checkpoint_loads_at_another_world_size(ranks, tmp_path):
    """Saved sharded on dim 1 over 2 ranks, loaded sharded on dim 1 over 4: the same whole
    parameters and optimizer state."""
    saved = ranks.run(check_save_on_dim_1, path=str(tmp_path), world_size=2)[0]
    for loaded in ranks.run(check_load_on_dim_1, path=str(tmp_path), world_size=4):
        assert loaded == saved


def check_with_policies() -> list[float]:
    """Dim-1 shards under bf16 mixed precision and under CPU offload: as torch's."""
    from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return [
        train_and_compare(Transformer, lm_loss, token_batch, shard_placement_fn=shard_dim_1,
                          mp_policy=bf16,
                          reference_tolerance={"rtol": 5e-2, "atol": 5e-2}).vs_torch,
        train_and_compare(Transformer, lm_loss, token_batch, shard_placement_fn=shard_dim_1,
                          offload_policy=CPUOffloadPolicy(pin_memory=False)).vs_torch,
    ]


def test_with_mixed_precision_and_offload(ranks):
    for errors in ranks.run(check_with_policies):
        assert errors == [0.0, 0.0]


class MixedDtypes(nn.Module):
    """float32 layers beside a frozen float64 scale in one unit: gathered as bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 6)
        self.second = nn.Linear(6, 8)
        self.scale = nn.Parameter(
            torch.linspace(0.5, 1.5, 8, dtype=torch.float64), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.second(torch.relu(self.first(x))).double() * self.scale).float()


def check_mixed_dtypes() -> tuple[float, float]:
    return train_and_compare(MixedDtypes, mse_loss, feature_batch, shard_placement_fn=shard_dim_1,
                             wrap=lambda model, shard: shard(model))


def test_with_mixed_dtypes_in_the_unit(ranks):
    """Weights on dim 1 arrive from the byte all-gather into their strided targets."""
    for vs_reference, vs_torch in ranks.run(check_mixed_dtypes):
        assert vs_torch == 0.0 and vs_reference < 1e-5


def check_an_all_reduce_hook_on_a_unit_of_two_meshes() -> dict[str, object]:
    """torchft's pattern with MoE: set_all_reduce_hook on units whose parameters sit on two
    meshes. The hook runs once per mesh with that mesh's reduced gradients; here it triples
    them in place (exact), so each block gradient is three times the unhooked model's."""
    import torch.distributed as dist
    experts_apart = experts_on_their_own_mesh()
    _, hooked, plain = three_models(Transformer, shard_placement_fn=experts_apart,
                                    shard_fns=(fully_shard, fully_shard))
    calls: list[int] = []

    def hook(reduced: torch.Tensor) -> None:
        calls.append(reduced.numel())
        reduced.mul_(3.0)  # an exact change, checked against the unhooked model below

    for block in hooked.blocks:
        block.set_all_reduce_hook(hook)
    batch = token_batch(0, 8).chunk(dist.get_world_size())[dist.get_rank()]
    for model in (hooked, plain):
        lm_loss(model, batch).backward()
    grads = max(float((full(a.grad) - 3 * full(b.grad)).abs().max())
                for (n, a), b in zip(hooked.named_parameters(), plain.parameters())
                if n.startswith("blocks."))
    others = max(float((full(a.grad) - full(b.grad)).abs().max())
                 for (n, a), b in zip(hooked.named_parameters(), plain.parameters())
                 if not n.startswith("blocks."))
    return {"calls": calls, "blocks": grads, "others": others}


@needs_shard_placement_result
def test_an_all_reduce_hook_runs_once_per_mesh_of_its_unit(ranks):
    for result in ranks.run(check_an_all_reduce_hook_on_a_unit_of_two_meshes, world_size=4):
        # Two blocks, two meshes each: four calls, of two sizes (each mesh's shards).
        assert (
            len(result["calls"]) == 4 and len(set(result["calls"])) == 2
            and result["blocks"] == 0.0 and result["others"] == 0.0
        ), result
