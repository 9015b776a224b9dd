"""The whole-checkpoint section of docs/performance.md (benchmarks/full_state_dict.py's
results)."""

from __future__ import annotations

from report_format import command, provenance, table

FULL_STATE_DICT = """\
## Whole checkpoints

Rank 0's peak memory while writing a whole checkpoint of a sharded model:
`save_full_state_dict` (safetensors, a tensor gathered and written at a time) against
torch.distributed.checkpoint's `get_model_state_dict(full_state_dict=True, cpu_offload=True)`
followed by safetensors' `save_file` (the whole state dict on rank 0). The figure is the
resident set's peak above what rank 0 held before, float32 weights:

```bash
{command}
```

{ranks} gloo ranks ({provenance}):

{table}

Streaming holds about one tensor at a time, whatever the model's size: twice the largest
tensor here, as gloo's all-gather stages its output; the whole-state-dict way holds the
whole model and more.
"""


def full_state_dict_section(result: dict) -> str:
    config = result["config"]
    header = ["model", "weights", "largest tensor", "streamed", "DCP full state dict", "ratio"]
    rows = []
    for name, row in result["models"].items():
        streamed = row["save_full_state_dict"]["peak_extra_mib"]
        dcp = row["DCP full state dict"]["peak_extra_mib"]
        rows.append([name, f"{row['whole_mib']:.1f} MiB", f"{row['largest_tensor_mib']:.1f} MiB",
                     f"{streamed:.1f} MiB", f"{dcp:.1f} MiB", f"**{streamed / dcp:.2f}**"])
    return FULL_STATE_DICT.format(
        command=command("torchrun --nproc_per_node=2 benchmarks/full_state_dict.py", config, "CPU, gloo"),
        ranks=config["world_size"], provenance=provenance(config),
        table=table(header, "lrrrrr", rows),
    )
