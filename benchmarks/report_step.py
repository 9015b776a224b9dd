"""The training-step section of docs/performance.md (benchmarks/step.py's results) and
its chart."""

from __future__ import annotations

from pathlib import Path

from report_format import at_floor, command, duration, joined, kib, provenance, table

CONTENDERS = ("fsdp_compose", "FSDP2", "DDP", "floor")
# Columns a run may have (key, title, format): older results have no host time, and only
# GPU runs have MFU and hidden communication.
EXTRA_COLUMNS = (("host_seconds", "host ms", lambda s: f"{s * 1e3:.1f}"),
                 ("mfu", "MFU", lambda x: f"{x:.3f}"),
                 ("hidden_communication", "comm. hidden", lambda x: f"{x:.3f}"))
MODELS = {"gpt": "the GPT of `examples/train_gpt.py`", "llama": "the Llama of `benchmarks/llama.py`"}

STEP = """\
## Training step

One command trains {which} ({model}) under fsdp_compose, torch's
fully_shard (FSDP2), DDP and a single-process floor (the plain model on each rank's batch, no
communication), interleaved in rounds, and writes `benchmarks/results/step.json` and
`step.png` (`pip install "fsdp_compose[bench]"` for the chart):

```bash
{command}
```

{setting}, median of {rounds} rounds of {steps} steps ({provenance}):

{table}

{speed}

{figure}Bytes per step, counted at dispatch, against the analytic floor of one all-gather per
unit and pass (the root's parameters stay gathered from forward to backward) and one
reduce-scatter per unit:

{bytes_table}{copies}

{communication} {losses} The bound is sharded parameters, gradients and AdamW state, the root
unit, three block-sized buffers (one block computing, its gradient, the next prefetched) and
the floor's activations and temporaries at its peak; peak memory is tracked by category with
torch's `MemTracker`. {memory} {accelerator}

Between steps only the parameter and gradient shards stay allocated; within a step a unit
frees its parameters before its gradients are reduced, and its communication buffers as
soon as their collective is done. The tests hold the peak to FSDP2's on the same run
(`tests/test_peak_memory.py`), with one exception by design: a backward that adds into
existing `.grad`s (no `zero_grad` in between) keeps its reduced shards apart until it
finishes, so that a backward that raises leaves the earlier gradients as they were. That
costs at most one more copy of the gradient shards while it runs.
"""


def step_section(result: dict, figure: str | None) -> str:
    config, memory = result["config"], result["peak_memory"]
    bound = result["analytic"]["memory_bound"]
    world, device = config["world_size"], config.get("device", "cpu")
    backend = config.get("backend", "nccl" if device.startswith("cuda") else "gloo")
    cpus = config.get("machine", {}).get("cpus")
    gpu = config.get("machine", {}).get("gpu")
    if device.startswith("cuda"):
        setting = f"{world} ranks on {gpu or 'GPU'}s ({backend})"
    else:
        setting = f"{world} ranks on a {cpus}-core CPU machine ({backend})" if cpus else \
            f"{world} ranks on CPU ({backend})"
    dtype = str(config.get("dtype", "torch.float32")).removeprefix("torch.")
    if dtype != "float32":
        setting += f", {dtype}"
    rows = []
    for name in CONTENDERS:
        vs_fsdp2 = f"{result['vs_fsdp2'][name]:.2f}"
        rows.append([name, f"{result['step_seconds'][name] * 1e3:.1f}",
                     f"**{vs_fsdp2}**" if name == "fsdp_compose" else vs_fsdp2,
                     f"{result['vs_floor'][name]:.2f}", kib(memory[name]["Total"]),
                     f"{memory[name]['Total'] / bound:.2f}"])
    header = ["", "step ms", "vs FSDP2", "vs floor", "peak memory / rank", "vs FSDP analytic bound"]
    # Older results have no host time; each column shows only where the run measured it.
    extra = [(key, title, unit) for key, title, unit in EXTRA_COLUMNS if result.get(key)]
    for key, title, unit in extra:
        header.append(title)
        for row, name in zip(rows, CONTENDERS):
            value = result[key].get(name)
            row.append("" if value is None else unit(value))
    step_table = table(header, "lrrrrr" + "r" * len(extra), rows)
    return STEP.format(
        which=MODELS[config.get("model", "gpt")], model=model_summary(config),
        command=command(f"torchrun --nproc_per_node={world} benchmarks/step.py", config,
                        f"{device.split(':')[0].upper()}, {backend}"
                        + (f": {duration(config)}" if duration(config) else "")),
        setting=setting, rounds=config["rounds"], steps=config["steps"],
        provenance=provenance(config), table=step_table, speed=step_speed(result),
        figure=f"![Median step time and peak memory per rank, by category]({figure})\n\n" if figure else "",
        bytes_table=bytes_table(result), copies=copies_table(result),
        communication=step_communication(result),
        losses=step_losses(result["max_loss_difference_vs_fsdp2"]),
        memory=step_memory(memory, bound), accelerator=step_accelerator(result, device),
    )


def model_summary(config: dict) -> str:
    said = (f"{config['depth']} blocks, dim {config['dim']}, seq {config['seq']}, batch "
            f"{config['batch']} per rank, AdamW")
    if config.get("mixed_precision"):
        said += ", bfloat16 mixed precision, by autocast for DDP and the floor"
    if config.get("compile"):
        said += f", each block compiled ({config.get('compile_backend', 'inductor')})"
    return said


def step_speed(result: dict) -> str:
    fsdp2, floor = result["vs_fsdp2"], result["vs_floor"]
    ours = fsdp2["fsdp_compose"]
    than = f"{(1 - ours) * 100:.0f} % less time than FSDP2's" if ours < 1 else \
        f"{(ours - 1) * 100:.0f} % more time than FSDP2's" if ours > 1 else "as long as FSDP2's"
    return (f"fsdp_compose's step takes {than} ({ours:.2f} ×) and {floor['fsdp_compose']:.2f} × "
            f"the floor's; DDP's takes {fsdp2['DDP']:.2f} × FSDP2's and {floor['DDP']:.2f} × the "
            f"floor's, and FSDP2's {floor['FSDP2']:.2f} × the floor's.")


def bytes_table(result: dict) -> str:
    comm, floor = result["communication"], result["analytic"]

    def cell(value: int | None) -> str:
        return "–" if value is None else f"{value:,}"

    rows = []
    for name in ("fsdp_compose", "FSDP2", "DDP"):
        if name not in comm:
            continue
        calls, sent = comm[name]["calls"], comm[name]["bytes"]
        rows.append([name, cell(calls.get("all_gather")), cell(sent.get("all_gather")),
                     cell(calls.get("reduce_scatter")), cell(sent.get("reduce_scatter")),
                     cell(sent.get("all_reduce"))])
    rows.append(["analytic floor", cell(floor["all_gather_calls"]), cell(floor["all_gather_bytes"]),
                 cell(floor["reduce_scatter_calls"]), cell(floor["reduce_scatter_bytes"]),
                 f"{floor['ddp_all_reduce_bytes']:,} (DDP)"])
    text = table(["", "all-gathers", "all-gathered B", "reduce-scatters", "reduce-scattered B",
                  "all-reduced B"], "lrrrrr", rows)
    return text + ("\n\nDDP all-reduces from C++, out of the counter's sight: its figure is the "
                   "gradients' bytes, one all-reduce of each per step.")


COPIES = """

Bytes copied outside the collectives per step and rank, counted at dispatch by op (what
each writes), with the copies the plain model makes itself, computing in the FSDPs' dtype
("model's own"), which every contender's count includes.{eager} The FSDP floor beyond the
model's own is {floor:,} B: a zero-copy design gathers nothing through a copy (the shards
stay in the all-gather's input, the unsharded parameters are views of its output, and
backward writes the gradients into the reduce-scatter's input){casts}.

{table}

fsdp_compose copies {ours:,} B beyond the model's own, {vs_fsdp2} FSDP2's {theirs:,} B."""


def copies_table(result: dict) -> str:
    """The copies outside collectives against their floor; nothing for older results."""
    copies, floor = result.get("copies"), result["analytic"]
    if not copies:
        return ""
    own = copies["model"]["total_bytes"]
    kinds = sorted({kind for counted in copies.values() for kind in counted["bytes"]})
    rows = []
    for name in (*CONTENDERS, "model"):
        counted = copies[name]
        by_kind = [f"{counted['bytes'].get(kind, 0):,}" for kind in kinds]
        beyond = "" if name == "model" else f"{counted['total_bytes'] - own:,}"
        rows.append([name if name != "model" else "model's own", *by_kind, f"{counted['total_bytes']:,}", beyond])
    rows.append(["FSDP floor", *("" for _ in kinds), "", f"{floor['copy_bytes']:,}"])
    if "copy_one_reduce_scatter_bytes" in floor:
        rows.append(["floor, one reduce-scatter per unit", *("" for _ in kinds), "",
                     f"{floor['copy_one_reduce_scatter_bytes']:,}"])
    ours, theirs = (copies[n]["total_bytes"] - own for n in ("fsdp_compose", "FSDP2"))
    casts = "" if not floor["copy_bytes"] else (
        f"; mixed precision adds the casts: each all-gather's input to param_dtype "
        f"({floor['copy_param_cast_bytes']:,} B) and the gradients to reduce_dtype "
        f"({floor['copy_grad_cast_bytes']:,} B)")
    eager = (" Under torch.compile the counted step runs eagerly (dynamo skips frames while "
             "a dispatch mode is active).") if result["config"].get("compile") else ""
    return COPIES.format(
        eager=eager, floor=floor["copy_bytes"], casts=casts, ours=ours, theirs=theirs,
        table=table(["", *(f"`{k}` B" for k in kinds), "total B", "beyond the model's own B"],
                    "l" + "r" * (len(kinds) + 2), rows),
        vs_fsdp2=f"{ours / theirs:.2f} ×" if theirs else "against",
    )


def step_communication(result: dict) -> str:
    comm, floor = result["communication"], result["analytic"]
    ours = comm["fsdp_compose"]
    calls, sent = ours["calls"], ours["bytes"]
    said = (f"Per step fsdp_compose issues {calls.get('all_gather', 0)} all-gathers "
            f"({sent.get('all_gather', 0):,} B) and {calls.get('reduce_scatter', 0)} reduce-scatters "
            f"({sent.get('reduce_scatter', 0):,} B)")
    same = ours == comm.get("FSDP2")
    if at_floor(ours, floor):
        return said + (": one per unit per pass, exactly the analytic floor"
                       + (" and what FSDP2 sends." if same else ", where FSDP2 sends otherwise."))
    return said + (f", against an analytic floor of {floor['all_gather_calls']} all-gathers "
                   f"({floor['all_gather_bytes']:,} B) and {floor['reduce_scatter_calls']} "
                   f"reduce-scatters ({floor['reduce_scatter_bytes']:,} B)"
                   + ("; FSDP2 sends the same." if same else "; FSDP2 sends otherwise."))


def step_losses(differences: dict) -> str:
    ours, ddp = differences["fsdp_compose"], differences["DDP"]
    if ours == 0 and ddp == 0:
        return "Losses are equal to FSDP2's and DDP's to the last bit."
    if ours == 0:
        return (f"Losses are equal to FSDP2's to the last bit; DDP's differ from FSDP2's by at "
                f"most {ddp:.3g}.")
    return (f"Losses differ from FSDP2's by at most {ours:.3g} (DDP's from FSDP2's by at most "
            f"{ddp:.3g}).")


def step_memory(memory: dict, bound: int) -> str:
    ours, theirs = memory["fsdp_compose"]["Total"], memory["FSDP2"]["Total"]
    if ours == theirs:
        said = f"In this run both sharded runtimes peak at {kib(ours)} per rank"
    else:
        said = (f"In this run fsdp_compose peaks at {kib(ours)} per rank, "
                f"{kib(abs(theirs - ours))} {'below' if ours < theirs else 'above'} FSDP2's {kib(theirs)}")
    return said + f", {ours / bound:.2f} of the bound ({kib(bound)})."


def step_accelerator(result: dict, device: str) -> str:
    if not device.startswith("cuda"):
        return ("On a GPU the same command runs on NCCL (e.g. with `--dtype bfloat16`) and also "
                "reports MFU (with `--peak-tflops`) and, from the profiler, the fraction of "
                "communication time hidden under compute; this run had no GPU, so it has neither.")
    said = []
    if result.get("mfu"):
        said.append("MFU (with `--peak-tflops`)")
    if result.get("hidden_communication"):
        said.append("the fraction of communication time hidden under compute, from the profiler")
    return "On the GPU the table adds " + joined(said) + "." if said else \
        "MFU needs `--peak-tflops`, which this run was not given."


def plot_step(result: dict, path: Path) -> bool:
    """Median step time of the four contenders and their peak memory per rank, by category,
    against the analytic bound. False, writing nothing, without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory, bound = result["peak_memory"], result["analytic"]["memory_bound"]
    config = result["config"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bars = left.bar(CONTENDERS, [result["step_seconds"][n] * 1e3 for n in CONTENDERS])
    left.bar_label(bars, fmt="%.1f", fontsize=8)
    left.set_ylabel("median step (ms)")
    categories = [c for c in next(iter(memory.values())) if c != "Total"]
    bottom = [0.0] * len(CONTENDERS)
    for category in categories:
        values = [memory[n].get(category, 0) / 1024 for n in CONTENDERS]
        if not any(values):
            continue
        right.bar(CONTENDERS, values, bottom=bottom, label=category)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.axhline(bound / 1024, color="black", linestyle="--", label="FSDP analytic bound")
    right.set_ylabel("peak memory per rank (KiB)")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    title = f"{config['world_size']} ranks, {config['device']}"
    if "date" in config:
        title += f", torch {config['torch']}, {config['date'][:10]}"
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
