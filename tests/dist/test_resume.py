"""Resume with everything: save_checkpoint / load_checkpoint keep an LR scheduler, a sampler
(any object with state_dict()), every rank's random number generators and the optimizer's
param groups whole, so a run killed and resumed equals the run never interrupted, bit for bit;
a checkpoint torch's DCP recipe saved loads too."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.optim.lr_scheduler import LambdaLR

from fsdp_compose import load_checkpoint, save_checkpoint
from tests.dist.parity import full
from tests.dist.training import new_run, sharded_transformer
from tests.models import lm_loss

STEPS, KILLED_AT = 6, 3


class SeededSampler:
    """A sampler with state: a seeded generator drawing each rank's batches."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed + dist.get_rank())

    def batch(self) -> torch.Tensor:
        return torch.randint(31, (2, 7), generator=self.generator)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def warmup_cosine(step: int) -> float:
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * step / STEPS))


def start(seed: int):
    model, optim = new_run(seed)
    return model, optim, LambdaLR(optim, warmup_cosine), SeededSampler(seed)


def run(steps: range, model, optim, sched, sampler) -> list[tuple[float, float]]:
    """Steps on the sampler's batches, noised by torch's and Python's generators, with a
    warmup-cosine LR; (loss, lr) per step."""
    out = []
    for _ in steps:
        tokens = sampler.batch()
        tokens = torch.where(torch.rand(tokens.shape) < 0.1, 0, tokens)  # torch's generator
        tokens = (tokens + random.randrange(3)) % 31  # Python's
        loss = lm_loss(model, tokens)
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        out.append((loss.item(), optim.param_groups[0]["lr"]))
    return out


def check_resume_equals_the_run_never_interrupted(path: str) -> dict[str, object]:
    torch.manual_seed(7)
    random.seed(7)
    whole = run(range(STEPS), *(uninterrupted := start(0)))
    torch.manual_seed(7)
    random.seed(7)
    killed = start(0)
    first = run(range(KILLED_AT), *killed)
    model, optim, sched, sampler = killed
    save_checkpoint(path, model, optim, step=KILLED_AT, extra={"sched": sched, "sampler": sampler},
                    rng=True)
    torch.manual_seed(99)  # the new process: other RNG states, other values everywhere
    random.seed(99)
    resumed = start(5)
    step = load_checkpoint(path, resumed[0], resumed[1],
                           extra={"sched": resumed[2], "sampler": resumed[3]}, rng=True)
    rest = run(range(step, STEPS), *resumed)
    params = max(float((full(a) - full(b)).abs().max())
                 for a, b in zip(uninterrupted[0].parameters(), resumed[0].parameters()))
    return {"whole": whole, "resumed": first + rest, "params": params, "step": step}


def test_a_killed_run_resumes_bit_for_bit(ranks, tmp_path):
    for result in ranks.run(check_resume_equals_the_run_never_interrupted,
                            path=str(tmp_path / "ckpt")):
        assert result["step"] == KILLED_AT
        assert result["resumed"] == result["whole"], result  # losses and learning rates
        assert result["params"] == 0.0


def check_a_scheduler_built_after_the_load(path: str) -> list[float]:
    """Resume, then build the scheduler where the run was: initial_lr came back."""
    model, optim, sched, sampler = start(0)
    run(range(KILLED_AT), model, optim, sched, sampler)
    save_checkpoint(path, model, optim, step=KILLED_AT)
    model, optim = new_run(1)
    step = load_checkpoint(path, model, optim)
    late = LambdaLR(optim, warmup_cosine, last_epoch=step - 1)
    return [late.get_last_lr()[0], sched.get_last_lr()[0]]


def test_a_scheduler_built_after_the_load_continues(ranks, tmp_path):
    results = ranks.run(check_a_scheduler_built_after_the_load, path=str(tmp_path / "c"))
    for late, original in results:
        assert late == original


class AppState:
    """torch's DCP recipe (the distributed checkpoint tutorial)."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state) -> None:
        raise AssertionError("not used")


def check_a_dcp_recipe_checkpoint_loads(path: str) -> tuple[float, str]:
    model, optim, sched, sampler = start(0)
    run(range(2), model, optim, sched, sampler)
    dcp.save({"app": AppState(model, optim)}, checkpoint_id=path)
    fresh, fresh_optim = new_run(1)
    load_checkpoint(path, fresh, fresh_optim)
    diff = max(
        float((full(a) - full(b)).abs().max())
        for a, b in zip(model.parameters(), fresh.parameters())
    )
    other = sharded_transformer(0, depth=3)  # one block more: none of its keys is there...
    dcp.save({"elsewhere": {"weights": other.state_dict()}}, checkpoint_id=path + "2")
    with pytest.raises(ValueError) as raised:
        load_checkpoint(path + "2", fresh)
    return diff, str(raised.value)


def test_a_checkpoint_of_torchs_dcp_recipe_loads_and_others_show_their_keys(ranks, tmp_path):
    for diff, message in ranks.run(check_a_dcp_recipe_checkpoint_loads, path=str(tmp_path / "d")):
        assert diff == 0.0
        assert (
            "holds none of the model's keys: its keys begin with ['elsewhere.weights.']" in message
        )


def check_asking_for_what_was_not_saved(path: str) -> list[str]:
    model, optim, sched, sampler = start(0)
    save_checkpoint(path, model, optim, extra={"sched": sched})
    messages = []
    for kwargs in ({"extra": {"sampler": sampler}}, {"rng": True}):
        with pytest.raises(ValueError) as raised:
            load_checkpoint(path, model, optim, **kwargs)
        messages.append(str(raised.value))
    return messages


def test_asking_for_state_not_saved_is_refused_alike(ranks, tmp_path):
    results = ranks.run(check_asking_for_what_was_not_saved, path=str(tmp_path / "e"))
    assert results[0] == results[1]
    assert "keeps no state of ['sampler'] (it keeps ['sched'])" in results[0][0]
    assert "keeps no random number generator states" in results[0][1]
