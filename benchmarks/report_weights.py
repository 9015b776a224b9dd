"""The weights-out-and-in section of docs/performance.md (benchmarks/weights.py's results)."""

from __future__ import annotations

from report_format import provenance, table

WEIGHTS = """\
## Weights out and in

A sharded model's weights whole, as an RL trainer sends them to an inference engine:
`iter_full_state_dict` (one all-gather per unit, or per piece of a unit past its largest tensor
and 4 MiB) against a loop of `full_tensor()` (one per tensor) and DCP's
`get_model_state_dict(full_state_dict=True, cpu_offload=True)`; and back in, whole tensors
streamed into `load_full_state_dict(model, pairs)` against DCP's
`set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)` (all of them at once
on rank 0). Peak: tensor memory above what was live (torch's MemTracker), each tensor dropped
as it arrives:

```bash
torchrun --nproc_per_node=2 benchmarks/weights.py
```

{ranks} gloo ranks ({provenance}):

{table}

With many small tensors, one gather per unit takes {small} the loop's time; with few large ones,
each goes alone and the peak stays one tensor.
"""


def weights_section(result: dict) -> str:
    config, models = result["config"], result["results"]
    header = ["model", "way", "ms", "vs the loop", "collectives", "peak"]
    rows = []
    for model, ways in models.items():
        loop = ways["out: full_tensor() loop"]["ms"]
        for way, r in ways.items():
            ratio = f"{r['ms'] / loop:.2f}" if way.startswith("out") else ""
            rows.append([model, way, f"{r['ms']:.1f}", ratio, f"{r['collectives']:.0f}",
                         f"{r['peak MiB']:.2f} MiB"])
    small = models["many small"]
    ratio = small["out: iter_full_state_dict"]["ms"] / small["out: full_tensor() loop"]["ms"]
    return WEIGHTS.format(ranks=config["world"], provenance=provenance(config),
                          table=table(header, "llrrrr", rows), small=f"{ratio:.2f} ×")
