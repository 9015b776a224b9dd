"""The gathering-in-place section of docs/performance.md (benchmarks/gather_in_place.py's
results)."""

from __future__ import annotations

from report_format import provenance, table

GATHER, IN_PLACE = "flat all-gather + copy-out", "in place"
REDUCE, REDUCE_EACH = "_chunk_cat + flat reduce-scatter", "per-parameter reduce-scatters"

SECTION = """\
## Gathering in place

The measurements behind the rule of docs/design.md ("Gathering in place"): one unit of a
transformer block's 12 parameters at several widths, µs per call, median of {rounds}
interleaved rounds of {calls} calls, on {world} gloo ranks and on a fake group of 8 (which
sends nothing: the runtime's side alone):

```bash
torchrun --nproc_per_node={world} benchmarks/gather_in_place.py
```

{provenance}

{table}

Gathering each parameter straight into its unsharded data, in one coalesced collective,
takes {gloo_gather} the time of the flat all-gather and its copy-out over gloo, and
{fake_gather} on the fake group: no clear win on the CPU, because neither backend writes
the outputs in place. Gloo flattens a coalesced gather's inputs and copies each rank's
rows out inside the collective, so the copy moves into the backend rather than vanishing;
whole training steps (the step section's run, and paired runs of it with in-place
gathering switched off) are equal within noise. fsdp_compose gathers in place there all
the same: it is the path a backend that writes each output in place (NCCL's grouped
all-gathers) makes copy-free, and the CPU proves it bit for bit. Per-parameter
reduce-scatters would skip the `_chunk_cat` into one flat input, and they give the same
bits, but over gloo they take {gloo_reduce} the time of the flat reduce-scatter, so the
reduction keeps its one copy."""


def ratios(by_dim: dict, ours: str, theirs: str) -> str:
    values = [row[ours] / row[theirs] for row in by_dim.values()]
    return f"{min(values):.2f}–{max(values):.2f} ×"


def gather_section(result: dict) -> str:
    config, timings = result["config"], result["us_per_call"]
    columns = [GATHER, IN_PLACE, REDUCE, REDUCE_EACH]
    rows = [[backend, dim, *(f"{row[c]:,.0f}" for c in columns)]
            for backend, by_dim in timings.items() for dim, row in by_dim.items()]
    return SECTION.format(
        rounds=config["rounds"], calls=config["calls"], world=config["world_size"],
        provenance=provenance(config),
        table=table(["group", "dim", *columns], "lr" + "r" * len(columns), rows),
        gloo_gather=ratios(timings["gloo"], IN_PLACE, GATHER),
        fake_gather=ratios(timings["fake"], IN_PLACE, GATHER),
        gloo_reduce=ratios(timings["gloo"], REDUCE_EACH, REDUCE),
    )
