"""plan(): its predicted peak memory per rank is within 10 % of a real 2-rank gloo run of
the same setup, its bytes per step are the run's, the setup it ranks first under a
budget fits that budget when run, and the calls it prints run as printed."""

from __future__ import annotations

import torch

from fsdp_compose import CPUOffloadPolicy, Setup, checkpoint_blocks, fully_shard, plan
from tests.dist.counting import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from tests.dist.planning import build, measured_peak
from tests.models import lm_loss, token_batch

SETUPS = [
    Setup(blocks_per_unit=1, reshard_after_forward=True),
    Setup(blocks_per_unit=2, reshard_after_forward=False),
    Setup(blocks_per_unit=1, reshard_after_forward=True, checkpoint_every=1),
    # On the CPU offload moves nothing (not a candidate there), but the setup must still
    # be simulated as it runs.
    Setup(blocks_per_unit=1, reshard_after_forward=True, cpu_offload=True),
]


def batch() -> torch.Tensor:
    return token_batch(0, 8)  # one rank's


def check_measured(setup: Setup) -> tuple[int, int]:
    """Rank 0's tracked peak over two steps, and one step's collective bytes, for real."""
    model = build()
    peak = measured_peak(setup, model, batch(), torch.device("cpu"))
    with CollectiveCounter() as counter:
        lm_loss(model, batch()).backward()
    return peak, counter.bytes[ALL_GATHER] + counter.bytes[REDUCE_SCATTER]


def test_predictions_match_real_runs(ranks):
    plans = {
        p.setup: p
        for p in plan(build, world_size=2, sample_input=batch(), loss_fn=lm_loss, setups=SETUPS)
    }
    for setup in SETUPS:
        measured_peak, measured_bytes = ranks.run(check_measured, setup=setup)[0]
        predicted = plans[setup]
        assert abs(predicted.peak_bytes - measured_peak) <= 0.10 * measured_peak, (
            setup, predicted, measured_peak
        )
        assert predicted.bytes_per_step == measured_bytes, setup
    # The setups differ: reshard_after_forward=False holds more, checkpointing less.
    peaks = [plans[s].peak_bytes for s in SETUPS]
    assert peaks[1] > peaks[0] > peaks[2], peaks
    assert "offload_policy=CPUOffloadPolicy()" in plans[SETUPS[3]].code


def test_the_first_under_a_budget_fits_it(ranks):
    setups = SETUPS[:3]
    free = plan(build, world_size=2, sample_input=batch(), loss_fn=lm_loss, setups=setups)
    budget = sorted(p.peak_bytes for p in free)[1]  # room for two of the three
    ranked = plan(build, world_size=2, sample_input=batch(), loss_fn=lm_loss, setups=setups,
                  memory_budget=budget)
    assert [p.fits for p in ranked].count(True) == 2 and ranked[0].fits
    assert "fully_shard(model)" in ranked[0].code
    measured_peak, _ = ranks.run(check_measured, setup=ranked[0].setup)[0]
    assert measured_peak <= budget



class MyBlock(torch.nn.Module):
    """A block class of the user's: fully_shard makes each instance an FSDPMyBlock, a class
    the user's code does not have. Counts its forward calls (recomputation calls it again)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(7, 7)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(self.linear(x))


class MyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(MyBlock() for _ in range(4))
        self.head = torch.nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def check_printed_calls_run(code: str) -> list[int]:
    """Run `code` as a user pastes it, on a fresh model; each block's forward calls in one
    step (2 where it was recomputed)."""
    model = MyModel()
    names = {"model": model, "MyBlock": MyBlock, "checkpoint_blocks": checkpoint_blocks,
             "fully_shard": fully_shard, "CPUOffloadPolicy": CPUOffloadPolicy}
    exec(code, names)
    model(torch.randn(4, 7)).sum().backward()
    return [block.calls for block in model.layers]


def test_the_printed_calls_name_the_users_block_class_and_run(ranks):
    (p,) = plan(
        MyModel, world_size=2, sample_input=torch.randn(4, 7), setups=[Setup(checkpoint_every=2)]
    )
    assert p.code == (
        "checkpoint_blocks(model, MyBlock, every=2)\n"
        "for block in model.layers:\n"
        "    fully_shard(block)\n"
        "fully_shard(model)"
    )
    assert ranks.run(check_printed_calls_run, code=p.code) == [[2, 1, 2, 1]] * 2
