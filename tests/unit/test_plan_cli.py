"""python -m fsdp_compose.plan ranks the example GPT's setups and prints the calls of the
best one that fits the budget; a budget nothing fits says so."""

from __future__ import annotations

import re

from fsdp_compose._planner import candidates
from fsdp_compose.plan import main, parse_size


def test_sizes_parse_in_binary_units():
    assert parse_size("64MiB") == parse_size("64mb") == 64 * 2**20
    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("2048") == 2048


def test_ranks_the_example_gpt(capsys):
    main(["--model", "gpt", "--world-size", "2", "--depth", "2", "--budget", "64MiB"])
    out = capsys.readouterr().out
    rows = re.findall(r"^  \d block\(s\)/unit.*: peak ([\d.]+) (KiB|MiB), .* fits$", out, re.MULTILINE)
    assert len(rows) == 12  # 1 and 2 blocks per unit, reshard True/False, 3 checkpointings
    assert "realised by:\nfor block in model.blocks:" in out and out.rstrip().endswith("fully_shard(model)")


def test_says_when_nothing_fits(capsys):
    main(["--model", "gpt", "--world-size", "2", "--depth", "2", "--budget", "1KiB"])
    assert "no setup fits the budget" in capsys.readouterr().out


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
