"""torch's elementwise optimizers step our sharded parameters on their local tensors
(param/local_step.py), invisibly: bit for bit FSDP2's training and optimizer state, and at
every moment the objects FSDP2 shows: DTensors in param groups, state and step hooks; LR
schedulers built at any time, state edited between steps, closures, without a warning torch
would not print."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import lr_scheduler
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import fully_shard, set_local_optimizer_step
from tests.dist.parity import (
    backward,
    full,
    max_diff_to,
    optimizer_step,
    rank_share,
    three_models,
)
from tests.models import Transformer, lm_loss, token_batch

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)
VARIANTS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# Fused kernels DTensor has a sharding strategy for (fused SGD and Adagrad fail on FSDP2's
# parameters).
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


class KernelInputs(TorchDispatchMode):
    """Whether the optimizer's arithmetic (foreach, fused and per-tensor kernels) was given
    DTensors."""

    def __init__(self) -> None:
        super().__init__()
        self.got_dtensors = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().startswith(("aten::_foreach", "aten::_fused", "aten::add", "aten::mul")):
            self.got_dtensors |= DTensor in types
        return func(*args, **(kwargs or {}))


def seen_by_hooks(optim: torch.optim.Optimizer, seen: list[set[type]]) -> None:
    """Record the types a pre- and a post-hook find in the param groups and the state."""
    def record(opt, args, kwargs):
        seen.append({type(p) for g in opt.param_groups for p in g["params"]}
                    | {type(v) for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0})
    optim.register_step_pre_hook(record)
    optim.register_step_post_hook(record)


def check_steps_like_fsdp2(name: str, variant: str) -> dict[str, object]:
    ref, ours, theirs = three_models(Transformer)
    optims = [make_optimizer(name, variant, m.parameters()) for m in (ours, theirs)]
    seen: list[set[type]] = []
    seen_by_hooks(optims[0], seen)
    world, vs_torch, kernels = dist.get_world_size(), 0.0, []
    for step in range(3):
        backward((ref, ours, theirs), token_batch(step, 2 * world), lm_loss)
        ref.zero_grad()
        with KernelInputs() as mode:
            optims[0].step()
        kernels.append(mode.got_dtensors)
        optimizer_step(optims[1:])
        optims[0].zero_grad()
        vs_torch = max(vs_torch, max_diff_to(ours, theirs))
    ours_state, their_state = whole_state(optims[0]), whole_state(optims[1])
    assert [k for k, _ in ours_state] == [k for k, _ in their_state]
    state_diff = max((float((a.double() - b.double()).abs().max()) for (_, a), (_, b)
                      in zip(ours_state, their_state) if a.numel()), default=0.0)
    return {"vs_torch": vs_torch, "state": state_diff, "seen": seen, "kernels": kernels}


@pytest.mark.parametrize(("name", "variant"), cases())
def test_an_elementwise_optimizer_steps_on_local_tensors_as_fsdp2_steps(ranks, name, variant):
    result = ranks.run(check_steps_like_fsdp2, name=name, variant=variant)[0]
    assert result["vs_torch"] == 0.0 and result["state"] == 0.0, result
    assert result["kernels"] == [False] * 3  # every step's arithmetic on local tensors
    # Hooks before and after every step find DTensors only, in param groups and state.
    assert len(result["seen"]) == 6 and all(
        all(issubclass(t, DTensor) for t in types) for types in result["seen"]), result["seen"]


def check_switched_off() -> tuple[float, list[bool]]:
    ref, ours, theirs = three_models(Transformer)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    kernels = []
    set_local_optimizer_step(False)
    try:
        for step in range(2):
            backward((ref, ours, theirs), token_batch(step, 4), lm_loss)
            with KernelInputs() as mode:
                optims[0].step()
            kernels.append(mode.got_dtensors)
            optims[1].step()
            for optim in optims:
                optim.zero_grad()
    finally:
        set_local_optimizer_step(True)
    return max_diff_to(ours, theirs), kernels


def test_set_local_optimizer_step_false_steps_on_the_dtensors(ranks):
    vs_torch, kernels = ranks.run(check_switched_off)[0]
    assert vs_torch == 0.0 and kernels == [True, True]


class CheckedAdamW(torch.optim.AdamW):
    """A user's subclass: its own code sees DTensors, the arithmetic runs locally."""

    def step(self, closure=None):
        assert all(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        return super().step(closure)


def check_a_subclass_steps_as_fsdp2() -> float:
    ref, ours, theirs = three_models(Transformer)
    optims = [CheckedAdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(2):
        backward((ref, ours, theirs), token_batch(step, 4), lm_loss)
        optimizer_step(optims)
    return max_diff_to(ours, theirs)


def test_a_subclass_of_an_elementwise_optimizer_steps_as_fsdp2(ranks):
    assert ranks.run(check_a_subclass_steps_as_fsdp2)[0] == 0.0


def check_a_failed_step_leaves_the_dtensors() -> tuple[bool, float]:
    ref, ours, theirs = three_models(Transformer)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(2):
        backward((ref, ours, theirs), token_batch(step, 4), lm_loss)
        optimizer_step(optims)

    def fail(opt, args, kwargs):
        raise RuntimeError("a hook failed")

    handle = optims[0].register_step_post_hook(fail)
    backward((ref, ours, theirs), token_batch(2, 4), lm_loss)
    with pytest.raises(RuntimeError, match="a hook failed"):
        optims[0].step()
    handle.remove()
    optims[1].step()
    kept = all(isinstance(p, DTensor) for g in optims[0].param_groups for p in g["params"])
    kept = kept and all(isinstance(v, DTensor) for s in optims[0].state.values()
                        for v in s.values() if v.dim() > 0)
    optimizer_step(optims)
    return kept, max_diff_to(ours, theirs)


def test_a_failed_step_leaves_the_dtensors_in_place(ranks):
    kept, vs_torch = ranks.run(check_a_failed_step_leaves_the_dtensors)[0]
    assert kept and vs_torch == 0.0


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
    return max_diff_to(ours, theirs), moved and "step" not in vars(optims[0])


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
    kernels = []
    for step in range(2):
        lm_loss(model, token_batch(step, 2)).backward()
        with KernelInputs() as mode:
            optimizer_step([optim])
        kernels.append(mode.got_dtensors)
    return kernels


def test_a_model_sharded_on_meta_steps_on_local_tensors(ranks):
    assert ranks.run(check_a_model_sharded_on_meta_steps_on_local_tensors)[0] == [False, False]


# -- what a training script does around the optimizer, compared with FSDP2 doing the same


SCHEDULERS = {
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
    "MultiplicativeLR": lambda o: lr_scheduler.MultiplicativeLR(o, lambda s: 0.9),
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "MultiStepLR": lambda o: lr_scheduler.MultiStepLR(o, milestones=[1, 2]),
    "ConstantLR": lambda o: lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=3),
    "ExponentialLR": lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: lr_scheduler.PolynomialLR(o, total_iters=4),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=4),
    "CosineAnnealingWarmRestarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2),
    "CyclicLR": lambda o: lr_scheduler.CyclicLR(
        o, 1e-3, 1e-2, step_size_up=2, cycle_momentum=False),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=0),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.ConstantLR(o, factor=0.5, total_iters=1),
            lr_scheduler.ExponentialLR(o, gamma=0.9)], milestones=[1]),
    "ChainedScheduler": lambda o: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(o, factor=0.5, total_iters=1),
         lr_scheduler.ExponentialLR(o, gamma=0.9)]),
}


def check_schedulers(built_at: int) -> dict[str, object]:
    """Each scheduler built before the first step (built_at 0), after it (1), or after a
    DCP load into a fresh optimizer (-1), for ours and for FSDP2: the learning rates, the
    parameters, and every warning either run printed, per scheduler."""
    out = {}
    for name, make in SCHEDULERS.items():
        _, ours, theirs = three_models(Transformer)
        optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
        runs: dict[str, list[str]] = {"ours": [], "fsdp2": []}
        lrs: dict[str, list[float]] = {"ours": [], "fsdp2": []}
        scheds = {}
        for who, model, optim in zip(runs, (ours, theirs), optims):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if built_at == -1:  # resume: DCP's state into a fresh optimizer first
                    set_optimizer_state_dict(model, optim, get_optimizer_state_dict(model, optim))
                if built_at <= 0:
                    scheds[who] = make(optim)
                for step in range(4):
                    lm_loss(model, rank_share(token_batch(step, 4))).backward()
                    optim.step()
                    optim.zero_grad()
                    if step + 1 == built_at:
                        scheds[who] = make(optim)
                    if who in scheds:
                        sched = scheds[who]
                        if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
                            sched.step(1.0)
                        else:
                            sched.step()
                    lrs[who].append(optim.param_groups[0]["lr"])
            runs[who] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
        out[name] = {"warnings": runs, "lrs": lrs, "vs_torch": max_diff_to(ours, theirs)}
    return out


@pytest.mark.parametrize("built_at", [0, 1, -1], ids=["before", "after", "after-load"])
def test_every_lr_scheduler_runs_as_on_fsdp2_without_a_warning_it_does_not_print(ranks, built_at):
    results = ranks.run(check_schedulers, built_at=built_at)[0]
    for name, result in results.items():
        assert result["warnings"]["ours"] == result["warnings"]["fsdp2"], (name, result)
        assert result["lrs"]["ours"] == result["lrs"]["fsdp2"], (name, result)
        assert result["vs_torch"] == 0.0, (name, result)


def check_state_edits(edit: str) -> dict[str, object]:
    """Two steps, an edit of the optimizer state, two more steps, on ours and on FSDP2."""
    ref, ours, theirs = three_models(Transformer)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    sizes = []
    for step in range(4):
        backward((ref, ours, theirs), token_batch(step, 4), lm_loss)
        optimizer_step(optims)
        if step == 1:
            for model, optim in zip((ours, theirs), optims):
                first = next(model.parameters())
                if edit == "clear":
                    optim.state.clear()
                elif edit == "del":
                    del optim.state[first]
                else:  # a moment zeroed by assignment
                    optim.state[first]["exp_avg"] = torch.zeros_like(first)
                sizes.append(len(optim.state_dict()["state"]))
    sizes += [len(o.state_dict()["state"]) for o in optims]
    ours_state, their_state = whole_state(optims[0]), whole_state(optims[1])
    state_diff = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(ours_state, their_state))
    return {"vs_torch": max_diff_to(ours, theirs), "state": state_diff, "sizes": sizes,
            "keys": [k for k, _ in ours_state] == [k for k, _ in their_state]}


@pytest.mark.parametrize("edit", ["clear", "del", "assign"])
def test_optimizer_state_edited_between_steps_counts_as_on_fsdp2(ranks, edit):
    result = ranks.run(check_state_edits, edit=edit)[0]
    assert result["vs_torch"] == 0.0 and result["state"] == 0.0 and result["keys"], result
    assert result["sizes"][0] == result["sizes"][1] and result["sizes"][2] == result["sizes"][3]


def check_hooks_see_fsdp2s_objects() -> dict[str, list]:
    """Per-optimizer and global step hooks compute a gradient norm and look a model
    parameter up in the param groups and the state."""
    ref, ours, theirs = three_models(Transformer)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    seen: dict[str, list] = {"ours": [], "fsdp2": []}
    handles = []
    for who, model, optim in zip(seen, (ours, theirs), optims):
        first = next(model.parameters())

        def look(opt, args, kwargs, who=who, first=first, optim=optim):
            if opt is not optim:
                return
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else None
            in_groups = any(p is first for g in opt.param_groups for p in g["params"])
            seen[who].append((None if norm is None else float(full(norm)), in_groups,
                              sorted(opt.state.get(first, {}))))
        handles += [optim.register_step_pre_hook(look), optim.register_step_post_hook(look),
                    register_optimizer_step_pre_hook(look),
                    register_optimizer_step_post_hook(look)]
    try:
        for step in range(3):
            backward((ref, ours, theirs), token_batch(step, 4), lm_loss)
            optimizer_step(optims)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_step_hooks_see_the_dtensors_and_the_numbers_fsdp2s_see(ranks):
    seen = ranks.run(check_hooks_see_fsdp2s_objects)[0]
    assert len(seen["ours"]) == 12 and seen["ours"] == seen["fsdp2"], seen


def check_grad_scaler_and_a_group_added() -> float:
    """GradScaler (unscale, inf checks, step through it) and add_param_group between steps:
    the blocks first, the rest added after two steps."""
    ref, ours, theirs = three_models(Transformer)
    optims, scalers = [], []
    for model in (ours, theirs):
        blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
        optims.append(torch.optim.AdamW(blocks, lr=1e-2))
        scalers.append(torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    for step in range(4):
        if step == 2:
            for model, optim in zip((ours, theirs), optims):
                optim.add_param_group({"params": [p for n, p in model.named_parameters()
                                                  if not n.startswith("blocks.")], "lr": 5e-3})
        for model, optim, scaler in zip((ours, theirs), optims, scalers):
            loss = lm_loss(model, rank_share(token_batch(step, 4)))
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
    return max_diff_to(ours, theirs)


def test_grad_scaler_and_add_param_group_step_as_on_fsdp2(ranks):
    assert ranks.run(check_grad_scaler_and_a_group_added)[0] == 0.0


def check_a_group_mixing_plain_and_sharded_parameters(variant: str) -> tuple[float, list[bool]]:
    """An ignored (plain) parameter first in the optimizer's group, then sharded ones."""
    import copy

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    ref = Transformer()
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = copy.deepcopy(ref)
        ignored = {model.pos_emb}
        for block in model.blocks:
            shard(block, ignored_params=ignored)
        shard(model, ignored_params=ignored)
        models.append(model)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, **VARIANTS[variant]) for m in models]
    assert not isinstance(next(models[0].parameters()), DTensor)  # the plain one first
    kernels = []
    for step in range(2):
        for model in models:
            lm_loss(model, rank_share(token_batch(step, 4))).backward()
        for model in models:  # the ignored parameter is not reduced: average it by hand
            grad = model.pos_emb.grad
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        with KernelInputs() as mode:
            optims[0].step()
        kernels.append(mode.got_dtensors)
        optimizer_step(optims[1:])
        optims[0].zero_grad()
    return max_diff_to(*models), kernels


def test_a_group_mixing_plain_and_sharded_parameters_steps_as_fsdp2(ranks):
    # (for-loop: FSDP2's foreach step refuses a list mixing tensors and DTensors)
    vs_torch, kernels = ranks.run(check_a_group_mixing_plain_and_sharded_parameters,
                                  variant="for-loop")[0]
    assert vs_torch == 0.0 and kernels == [False, False]
