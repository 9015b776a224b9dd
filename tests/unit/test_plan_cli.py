"""python -m fsdp_compose.plan ranks the example GPT's setups and prints the calls of the
best one that fits the budget; a budget nothing fits says so, nearest miss first and by how
much each misses. plan() takes the budget as the command line does, and keeps torch's
MemTracker warnings to itself."""

from __future__ import annotations

import re
import warnings

import pytest

from fsdp_compose import Setup, plan
from fsdp_compose.plan import main, parse_size
from fsdp_compose.tools.planner import candidates, size
from tests.models import Transformer, lm_loss, token_batch

_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def test_sizes_parse_in_binary_units():
    assert parse_size("64MiB") == parse_size("64mb") == 64 * 2**20
    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("2048") == 2048
    for typo in ("4 MB/s", "1.2.3GiB", "MiB", "-1GiB"):
        with pytest.raises(ValueError, match=re.escape(f"not a size: {typo!r}")):
            parse_size(typo)


def test_ranks_the_example_gpt(capsys):
    main(["--model", "gpt", "--world-size", "2", "--depth", "2", "--budget", "64MiB"])
    out = capsys.readouterr().out
    rows = re.findall(r"^  \d block\(s\)/unit.*: peak ([\d.]+) (KiB|MiB), .* fits$", out, re.MULTILINE)
    assert len(rows) == 12  # 1 and 2 blocks per unit, reshard True/False, 3 checkpointings
    # Checkpointing in words, as checkpoint_blocks(every=n) does it (not "checkpoint every -").
    assert [len(re.findall(f"/unit, reshard_after_forward=(True|False), {words}: ", out)) for words in (
        "no activation checkpointing", "activation checkpointing of every block",
        "activation checkpointing of 1 block in 2")] == [4, 4, 4]
    assert "realised by:\nfor block in model.blocks:" in out and out.rstrip().endswith("fully_shard(model)")


def test_says_when_nothing_fits_nearest_miss_first_and_by_how_much(capsys):
    main(["--model", "gpt", "--world-size", "2", "--depth", "2", "--budget", "1MiB"])
    out = capsys.readouterr().out
    rows = re.findall(r"^  .*: peak ([\d.]+) (\w+), .*; does not fit: ([\d.]+) (\w+) over the 1.0 MiB budget$",
                      out, re.MULTILINE)
    assert len(rows) == 12, out
    peaks = [float(n) * _BYTES[unit] for n, unit, _, _ in rows]
    overs = [float(n) * _BYTES[unit] for _, _, n, unit in rows]
    assert peaks == sorted(peaks), peaks  # the nearest miss first
    for peak, over in zip(peaks, overs):  # each printed to 0.05 MiB
        assert abs(peak - over - 2**20) <= 0.1 * 2**20, (peak, over)
    assert "no setup fits the budget (nearest first above)" in out


def test_offload_is_a_candidate_where_it_moves_memory():
    on_cpu, on_accelerator = candidates(8, 4), candidates(8, 4, offload=True)
    assert not any(s.cpu_offload for s in on_cpu)
    assert len(on_accelerator) == 2 * len(on_cpu)
    assert {s for s in on_accelerator if not s.cpu_offload} == set(on_cpu)


def test_the_package_name_still_plans_after_the_module_is_imported():
    import fsdp_compose
    import fsdp_compose.plan  # noqa: F401  # (this file imported it already)
    from fsdp_compose import Setup
    from tests.models import Transformer, lm_loss, token_batch

    plans = fsdp_compose.plan(lambda: Transformer(depth=2), world_size=2, sample_input=token_batch(0, 2),
                              loss_fn=lm_loss, setups=[Setup()])
    assert len(plans) == 1 and plans[0].peak_bytes > 0 and plans[0].bytes_per_step > 0


def test_a_budget_may_be_a_size_as_on_the_command_line():
    (p,) = plan(lambda: Transformer(depth=2), world_size=2, sample_input=token_batch(0, 2),
                loss_fn=lm_loss, setups=[Setup()], memory_budget="1KiB")
    assert p.memory_budget == 1024 and p.fits is False
    assert str(p).endswith(f"; does not fit: {size(p.peak_bytes - 1024)} over the 1.0 KiB budget")


def test_a_budget_that_is_not_a_size_is_refused_before_simulating():
    built = []
    with pytest.raises(ValueError, match=re.escape("plan: memory_budget is not a size: '4 MB/s'")):
        plan(lambda: built.append(1) or Transformer(depth=2), world_size=2,
             sample_input=token_batch(0, 2), loss_fn=lm_loss, memory_budget="4 MB/s")
    assert built == []


def test_memtrackers_warning_is_not_shown():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan(lambda: Transformer(depth=2), world_size=2, sample_input=token_batch(0, 2),
             loss_fn=lm_loss, setups=[Setup(), Setup(checkpoint_every=1)])
    assert [str(w.message) for w in caught] == []
