"""python -m fsdp_compose.plan ranks the example GPT's setups in a table, says how it ranks
them and what the budget was read as, and prints the calls of the best one that fits the
budget; a budget nothing fits says so, nearest miss first and by how much each misses.
plan() takes the budget as the command line does (MB decimal, MiB binary, "64M" refused),
and keeps torch's MemTracker warnings to itself."""

from __future__ import annotations

import re
import warnings

import pytest

from fsdp_compose import Plan, Setup, plan
from fsdp_compose.plan import main, parse_size
from fsdp_compose.tools.planner import _rank, candidates, ranking, size, table
from tests.models import Transformer, lm_loss, token_batch

_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

# A row of the table: setup, peak per rank, communicated per step, verdict, 3 spaces apart.
_ROW = re.compile(r"^  (\d block\(s\)/unit, reshard_after_forward=\S+, [^\n]*?) {3,}"
                  r"(at least )?([\d.]+) (B|KiB|MiB) {3,}(\(not simulated\)|[\d.]+ \w+) {3,}(.*)$",
                  re.MULTILINE)


def test_sizes_parse_decimal_and_binary_units_and_refuse_a_bare_unit_letter():
    assert parse_size("64MiB") == parse_size("64mib") == parse_size("64 MiB") == 64 * 2**20
    assert parse_size("64MB") == parse_size("64mb") == 64 * 10**6  # "i" alone makes it binary
    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4.1MB") == 4_100_000  # exactly, not 4099999 from a float
    assert (parse_size("1kB"), parse_size("1KiB"), parse_size("1TB"), parse_size("1TiB")) == (
        10**3, 2**10, 10**12, 2**40)
    assert parse_size("2048") == parse_size("2048B") == 2048  # a bare number is bytes
    for typo in ("4 MB/s", "1.2.3GiB", "MiB", "-1GiB", "64iB"):
        with pytest.raises(ValueError, match=re.escape(f"not a size: {typo!r}")):
            parse_size(typo)
    advice = "say 64MiB (2^20 bytes) or 64MB (10^6 bytes)"
    for ambiguous in ("64M", "64m", "64Mi"):
        with pytest.raises(ValueError, match=re.escape(advice)):
            parse_size(ambiguous)
    with pytest.raises(ValueError, match=re.escape("say 5KiB (2^10 bytes) or 5kB (10^3 bytes)")):
        parse_size("5k")


def test_the_command_line_refuses_a_bare_unit_letter_with_the_hint(capsys):
    with pytest.raises(SystemExit):
        main(["--budget", "64M"])
    assert "say 64MiB (2^20 bytes) or 64MB (10^6 bytes)" in capsys.readouterr().err


def test_ranks_the_example_gpt(capsys):
    main(["--model", "gpt", "--world-size", "2", "--depth", "2", "--budget", "64MiB"])
    out = capsys.readouterr().out
    # What the budget was read as, and how the rows are ranked, before them.
    assert out.startswith("gpt, 2 ranks, budget 64MiB = 67,108,864 bytes (64.0 MiB) per rank.\n")
    assert " ".join(ranking(True).split()) in " ".join(out.split())
    assert re.search(r"^  setup +peak per rank +communicated per step +verdict$", out, re.MULTILINE)
    rows = _ROW.findall(out)
    assert len(rows) == 12, out  # 1 and 2 blocks per unit, reshard True/False, 3 checkpointings
    assert all(not least and sent != "(not simulated)" and verdict == "fits"
               for _, least, _, _, sent, verdict in rows)
    # Checkpointing in words, as checkpoint_blocks(every=n) does it (not "checkpoint every -").
    setups = [setup for setup, *_ in rows]
    head = r"\d block\(s\)/unit, reshard_after_forward=(True|False), "
    assert [sum(bool(re.fullmatch(head + words, s)) for s in setups) for words in (
        "no activation checkpointing", "activation checkpointing of every block",
        "activation checkpointing of 1 block in 2")] == [4, 4, 4]
    assert "realised by:\nfor block in model.blocks:" in out
    assert out.rstrip().endswith("fully_shard(model)")


def test_says_when_nothing_fits_nearest_miss_first_and_by_how_much(capsys):
    main(["--model", "gpt", "--world-size", "2", "--depth", "2", "--budget", "2MiB"])
    out = capsys.readouterr().out
    assert "budget 2MiB = 2,097,152 bytes (2.0 MiB) per rank" in out
    rows = [(bool(least), float(n) * _BYTES[unit], verdict)
            for _, least, n, unit, _, verdict in _ROW.findall(out)]
    assert len(rows) == 12, out
    # Checkpointing every block peaks at about 2.6 MiB, though its bound is about 1 MiB: it is
    # simulated; without checkpointing the bound alone (about 2.9 MiB) rules a setup out.
    bounded = [least for least, _, _ in rows]
    assert 0 < sum(bounded) < 12 and bounded == sorted(bounded), out  # the simulated misses first
    peaks = [peak for _, peak, _ in rows]
    simulated, not_simulated = peaks[:bounded.index(True)], peaks[bounded.index(True):]
    assert simulated == sorted(simulated) and not_simulated == sorted(not_simulated)
    # Each says by how much it misses: "at least" where only a lower bound is known.
    for least, peak, verdict in rows:  # each printed to 0.05 MiB
        over = re.fullmatch(r"does not fit: (at least )?([\d.]+) (\w+) over", verdict)
        assert over is not None and bool(over[1]) == least, verdict
        missed_by = float(over[2]) * _BYTES[over[3]]
        assert abs(peak - missed_by - 2 * 2**20) <= 0.1 * 2**20, (peak, verdict)
    assert "no setup fits the budget (nearest first above)" in out


def _plan(peak: int, fits: bool | None, simulated: bool = True, every: int | None = None) -> Plan:
    return Plan(Setup(checkpoint_every=every), peak, 1000 if simulated else None, fits, "",
                memory_budget=None if fits is None else 100, simulated=simulated)


def test_ranking_fits_by_cost_then_simulated_misses_nearest_first_then_ruled_out_by_bound():
    plans = [_plan(400, False, simulated=False), _plan(300, False), _plan(50, True, every=1),
             _plan(90, True), _plan(500, False, simulated=False), _plan(200, False),
             _plan(150, False, simulated=False)]
    ranked = sorted(plans, key=_rank)
    # Fitting: less recomputation first (the 90-byte peak without checkpointing before the
    # 50-byte one that recomputes every block); misses by peak; then the bounds, lowest first.
    assert [(p.peak_bytes, p.simulated) for p in ranked] == [
        (90, True), (50, True), (200, True), (300, True), (150, False), (400, False), (500, False)]
    assert "a lower bound" in ranking(True) and "nearest" in ranking(True)
    assert ranking(False).startswith("Ranked by less recomputation")


def test_the_table_aligns_its_columns_and_says_what_was_not_simulated():
    plans = [_plan(90, True), _plan(2**20, False), _plan(3 * 2**20, False, simulated=False)]
    lines = table(plans).splitlines()
    assert lines[0].split() == [
        "setup", "peak", "per", "rank", "communicated", "per", "step", "verdict"]
    starts = {tuple(m.start() for m in re.finditer(r"(?<=   )\S", line)) for line in lines}
    # Each column starts where its header does.
    assert len(starts) == 1 and len(next(iter(starts))) == 3, lines
    assert [re.split(r" {3,}", line.strip())[1:] for line in lines[1:]] == [
        ["90.0 B", "1000.0 B", "fits"],
        ["1.0 MiB", "1000.0 B", "does not fit: 1023.9 KiB over"],
        ["at least 3.0 MiB", "(not simulated)", "does not fit: at least 3.0 MiB over"],
    ]


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

    plans = fsdp_compose.plan(lambda: Transformer(depth=2), world_size=2,
                              sample_input=token_batch(0, 2), loss_fn=lm_loss, setups=[Setup()])
    assert len(plans) == 1 and plans[0].peak_bytes > 0 and plans[0].bytes_per_step > 0


def test_a_budget_may_be_a_size_as_on_the_command_line():
    (p,) = plan(lambda: Transformer(depth=2), world_size=2, sample_input=token_batch(0, 2),
                loss_fn=lm_loss, setups=[Setup()], memory_budget="1KiB")
    assert p.memory_budget == 1024 and p.fits is False
    # Its shards alone exceed a KiB: ruled out by its lower bound, not simulated.
    assert not p.simulated and p.bytes_per_step is None
    assert str(p) == (f"1 block(s)/unit, reshard_after_forward=True, no activation checkpointing | "
                      f"peak at least {size(p.peak_bytes)} | does not fit: at least "
                      f"{size(p.peak_bytes - 1024)} over the 1.0 KiB budget")
    (p,) = plan(lambda: Transformer(depth=2), world_size=2, sample_input=token_batch(0, 2),
                loss_fn=lm_loss, setups=[Setup()], memory_budget="1GB")
    assert p.memory_budget == 10**9 and p.fits and p.simulated and p.bytes_per_step
    assert str(p) == (f"1 block(s)/unit, reshard_after_forward=True, no activation checkpointing | "
                      f"peak {size(p.peak_bytes)} | "
                      f"{size(p.bytes_per_step)}/step communicated | fits")


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


FACTORY = '''
import torch
from tests.models import Transformer


def build():
    return Transformer(depth=2), torch.randint(31, (2, 6))
'''


def test_plans_a_model_of_mine_from_its_factory(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    main(["--model", "my_models:build", "--world-size", "2", "--budget", "64MiB"])
    out = capsys.readouterr().out
    assert out.startswith("my_models:build, 2 ranks, budget 64MiB")
    assert len(_ROW.findall(out)) == 12 and "realised by:\nfor block in model.blocks:" in out


def test_help_names_the_command_and_gives_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fsdp_compose.plan")
    assert "(default: 8)" in out and "package.module:factory" in out
    with pytest.raises(SystemExit):
        main(["--model", "nonsense"])
    assert "'nonsense' is not gpt, llama or package.module:factory" in capsys.readouterr().err
