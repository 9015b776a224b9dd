"""The optimizer section of docs/performance.md (benchmarks/optimizer.py's results)."""

from __future__ import annotations

from report_format import provenance, table

CONTENDERS = ("fsdp_compose", "FSDP2", "plain")

SECTION = """\
## The optimizer step

AdamW's step alone, ms, over the sharded parameters of 8 blocks (dim {dims}, 12 parameters
each) on a fake group of {world}, under each mixed-precision policy (what the parameters
are stored in does not change: float32), median of {rounds} interleaved rounds; "plain"
steps ordinary tensors holding the same local shards and gradients:

```bash
python benchmarks/optimizer.py
```

{provenance}

{table}

AdamW over fsdp_compose's parameters does its arithmetic on their local tensors while
everything else sees the DTensors (docs/design.md, "The optimizer step on local shards"): it
costs {plain_gap} the plain tensors' time and {ours_vs_fsdp2} FSDP2's, whose step pays
DTensor's dispatch on every op (the for-loop per parameter and op, foreach and fused once per
op over all parameters). What is left over plain tensors is torch's own loop over the
parameters reading DTensors (their `.grad` and state) and the unwrapping of the lists handed
to the arithmetic: about 0.1 ms per 96 parameters, most visible beside the fused kernel."""


def ratio_range(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f} ×"


def optimizer_section(result: dict) -> str:
    config, by_dim = result["config"], result["ms_per_step"]  # {"dim 64": {policy: {variant: ms}}}
    rows = [[dim.removeprefix("dim "), policy, variant, *(f"{ms[c]:.2f}" for c in CONTENDERS),
             f"{ms['fsdp_compose'] / ms['plain']:.2f}", f"{ms['fsdp_compose'] / ms['FSDP2']:.2f}"]
            for dim, steps in by_dim.items()
            for policy, by_variant in steps.items() for variant, ms in by_variant.items()]
    every = [ms for steps in by_dim.values() for by_variant in steps.values() for ms in by_variant.values()]
    return SECTION.format(
        dims=" and ".join(dim.removeprefix("dim ") for dim in by_dim), world=config["world"],
        rounds=config["rounds"], provenance=provenance(config),
        table=table(["dim", "policy", "AdamW", *CONTENDERS, "fsdp_compose / plain", "fsdp_compose / FSDP2"],
                    "lllrrrrr", rows),
        ours_vs_fsdp2=ratio_range([ms["fsdp_compose"] / ms["FSDP2"] for ms in every]),
        plain_gap=ratio_range([ms["fsdp_compose"] / ms["plain"] for ms in every]),
    )
