"""The scale section of docs/performance.md (benchmarks/scale.py's results)."""

from __future__ import annotations

import statistics

from report_format import at_floor, command, duration, joined, kib, provenance, table

SHARDED = ("fsdp_compose", "FSDP2")

SCALE = """\
## Scale

The same GPT at {world_range} ranks, one rank of each simulated in one process on the fake
process group (its collectives fill their outputs without other processes): per-rank peak
memory and bytes per step for both runtimes, against the analytic figures, and the CPU time
of a step (`--worlds`, `--rank` and the model's sizes are options):

```bash
{command}
```

{model}, rank {rank}, median of {steps} steps per size ({provenance}):

{table}

{floors} The figures also show what padding costs: every parameter is padded to W shards on
dim 0, so once W passes a dimension{largest} each rank keeps one padded row of it, the buffers
grow towards W rows per parameter, and the shards stop shrinking.{padding} {times}
"""


def scale_section(data: dict | list) -> str:
    config, worlds = (data["config"], data["worlds"]) if isinstance(data, dict) else ({}, data)
    rows, same_peak, at_floors = [], [], []
    for r in worlds:
        ours, theirs = (r["peak_memory"][n]["Total"] for n in SHARDED)
        floor, sent = r["analytic"], r["communication"]["fsdp_compose"]
        same_peak.append(ours == theirs)
        at_floors.append(at_floor(sent, floor) and sent == r["communication"]["FSDP2"])
        rows.append([str(r["world_size"]), kib(ours), kib(theirs), f"{ours / floor['memory_bound']:.2f}",
                     f"{sent['bytes'].get('all_gather', 0):,} B", f"{sent['bytes'].get('reduce_scatter', 0):,} B",
                     "yes" if at_floor(sent, floor) else "**no**",
                     f"{r['step_seconds']['fsdp_compose'] * 1e3:.1f}", f"{r['step_seconds']['FSDP2'] * 1e3:.1f}"])
    sizes = [r["world_size"] for r in worlds]
    scale_table = table(["W", "peak / rank", "FSDP2", "vs bound", "all-gathered", "reduce-scattered",
                         "= floor", "step ms", "FSDP2"], "rrrrrrcrr", rows)
    if all(same_peak):
        floors = "Both runtimes allocate the same peak at every size"
    else:
        differ = [str(w) for w, same in zip(sizes, same_peak) if not same]
        floors = f"The runtimes' peaks differ at W = {joined(differ)}"
    if all(at_floors):
        floors += (", and fsdp_compose sends exactly the analytic floor, as FSDP2 does (the "
                   "buffers' bytes; a ring sends (W-1)/W of each per rank).")
    else:
        off = [str(w) for w, ok in zip(sizes, at_floors) if not ok]
        floors += (f"; at W = {joined(off)} fsdp_compose does not send exactly the analytic floor "
                   "or not what FSDP2 sends (the buffers' bytes; a ring sends (W-1)/W of each per rank).")
    world_range = f"{sizes[0]} to {sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
    model = (f"GPT of {config['depth']} blocks, dim {config['dim']}, seq {config['seq']}, batch "
             f"{config['batch']}" if "depth" in config else "The GPT")
    comment = "W = " + ", ".join(map(str, sizes)) + (f": {duration(config)}" if duration(config) else "")
    return SCALE.format(
        world_range=world_range, command=command("python benchmarks/scale.py", config, comment),
        model=model, rank=config.get("rank", 0), steps=config.get("steps", "?"),
        provenance=provenance(config), table=scale_table, floors=floors,
        largest=f" (this model's largest is {config['largest_rows']} rows)" if "largest_rows" in config else "",
        padding=scale_padding(worlds), times=scale_times(worlds, config),
    )


def scale_padding(worlds: list[dict]) -> str:
    if len(worlds) < 2:
        return ""
    gathered = [r["communication"]["fsdp_compose"]["bytes"].get("all_gather", 0) for r in worlds]
    peaks = [r["peak_memory"]["fsdp_compose"]["Total"] for r in worlds]
    sizes = [r["world_size"] for r in worlds]
    said = ""
    flat = [w for w, b in zip(sizes, gathered) if b == gathered[0]]
    if gathered[-1] > gathered[0]:
        said += (f" Here the all-gathered bytes stay at {gathered[0]:,} B up to W = {flat[-1]} and "
                 f"reach {gathered[-1]:,} B ({gathered[-1] / gathered[0]:.1f} ×) at W = {sizes[-1]}")
    lowest = min(range(len(peaks)), key=peaks.__getitem__)
    if lowest < len(peaks) - 1:
        said += ("; " if said else " Here ") + (
            f"the peak per rank is lowest at W = {sizes[lowest]} ({kib(peaks[lowest])}) and "
            f"{kib(peaks[-1])} at W = {sizes[-1]}")
    return said + "." if said else ""


def scale_times(worlds: list[dict], config: dict) -> str:
    ratios = [r["step_seconds"]["fsdp_compose"] / r["step_seconds"]["FSDP2"] for r in worlds]
    said = (f"The step times (median of {config.get('steps', '?')}, most of them the fake group "
            f"filling its buffers) put fsdp_compose at {min(ratios):.2f}"
            + (f" to {max(ratios):.2f}" if len(ratios) > 1 else "") + " × FSDP2's")
    samples = worlds[-1].get("step_samples", {})
    spreads = [max(abs(s - statistics.median(t)) for s in t) / statistics.median(t)
               for t in samples.values() if len(t) > 1]
    if spreads:
        said += (f"; at W = {worlds[-1]['world_size']} a runtime's timed steps lie within "
                 f"±{max(spreads) * 100:.0f} % of their median, so small differences there are noise")
    return said + "."
