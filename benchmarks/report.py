"""Write docs/performance.md, and its chart docs/performance.png, from the benchmarks' JSON in
benchmarks/results/: every figure, and every statement that depends on one, from the results,
in this module's templates (a missing result leaves its section out, and says so). The chart
needs matplotlib (`pip install "fsdp_compose[bench]"`). Imports no torch: the benchmarks print
their tables with it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import textwrap
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

# Formatting

def kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def us(x: float) -> str:
    return f"{x:,.0f} µs"


def table(header: list[str], align: str, rows: list[list[str]]) -> str:
    """A markdown table; `align` has one character per column: l(eft), r(ight), c(entre)."""
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def provenance(config: dict) -> str:
    """When, with what, on what: from the config a benchmark recorded."""
    date = datetime.fromisoformat(config["date"]).strftime("%Y-%m-%d %H:%M UTC")
    machine = config["machine"]
    where = f"{machine['cpu']} ({machine['cpus']} cores)"
    if machine["gpu"]:
        where = f"{machine['gpu']}, {where}"
    return (f"{date}, torch {config['torch']}, Python {config['python']}, {where}, "
            f"{machine['platform']}")


def command(prefix: str, config: dict, comment: str) -> str:
    line = f"{prefix} {' '.join(config.get('argv', []))}".rstrip()
    return f"{line:<48} # {comment}" if comment else line


def duration(config: dict) -> str:
    seconds = config["wall_seconds"]
    return f"{seconds:.0f} s" if seconds < 100 else f"about {seconds / 60:.0f} minutes"


def joined(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def at_floor(comm: dict, floor: dict) -> bool:
    """Whether a runtime's collectives (calls and bytes) are the analytic floor's."""
    return all(comm[what] == {kind: floor[f"{kind}_{what}"] for kind in
                              ("all_gather", "reduce_scatter")} for what in ("calls", "bytes"))


# Training step (benchmarks/step.py)

CONTENDERS = ("fsdp_compose", "FSDP2", "DDP", "floor")
# Columns only some runs have (key, title, format): host time is newer than the first
# results, MFU and hidden communication are measured on GPUs only.
EXTRA_COLUMNS = (("host_seconds", "host ms", lambda s: f"{s * 1e3:.1f}"),
                 ("mfu", "MFU", lambda x: f"{x:.3f}"),
                 ("hidden_communication", "comm. hidden", lambda x: f"{x:.3f}"))
MODELS = {"gpt": "the GPT of `examples/train_gpt.py`",
          "llama": "the Llama of `benchmarks/models.py`"}

STEP = """\
## Training step

One command trains {which} ({model}) under fsdp_compose, torch's fully_shard (FSDP2), DDP and a
single-process floor (the plain model on each rank's batch, no communication), interleaved in
rounds, and writes `benchmarks/results/step.json` and `step.png` (`pip install
"fsdp_compose[bench]"` for the chart):

```bash
{command}
```

{setting}, median of {rounds} rounds of {steps} steps ({provenance}):

{table}

{speed}

{figure}Bytes per step, counted at dispatch, against the analytic floor of one all-gather per unit
and pass (the root's parameters stay gathered from forward to backward) and one reduce-scatter
per unit:

{bytes_table}

DDP all-reduces from C++, out of the counter's sight: its figure is the gradients' bytes, one
all-reduce of each per step.{copies}

{communication} {losses} The bound is sharded parameters, gradients and AdamW state, the root
unit, three block-sized buffers (one block computing, its gradient, the next prefetched) and the
floor's activations and temporaries at its peak; peak memory is tracked by category with torch's
`MemTracker`. {memory} {accelerator}

Between steps only the parameter and gradient shards stay allocated; within a step a unit frees
its parameters before its gradients are reduced, and its communication buffers as soon as their
collective is done. The tests hold the peak to FSDP2's on the same run
(`tests/test_peak_memory.py`), with one exception by design: a backward that adds into existing
`.grad`s (no `zero_grad` in between) keeps its reduced shards apart until it finishes, so that a
backward that raises leaves the earlier gradients as they were. That costs at most one more copy
of the gradient shards while it runs.
"""

COPIES = """

Bytes copied outside the collectives per step and rank, counted at dispatch by op (what each
writes), with the copies the plain model makes itself, computing in the FSDPs' dtype ("model's
own"), which every contender's count includes.{eager} The FSDP floor beyond the model's own is
{floor:,} B: a zero-copy design gathers nothing through a copy (the shards stay in the
all-gather's input, the unsharded parameters are views of its output, and backward writes the
gradients into the reduce-scatter's input){casts}.

{table}

fsdp_compose copies {ours:,} B beyond the model's own, {vs_fsdp2} FSDP2's {theirs:,} B."""


def step_section(result: dict, figure: str | None) -> str:
    config, memory = result["config"], result["peak_memory"]
    world, device, backend = config["world_size"], config["device"], config["backend"]
    setting = f"{world} ranks on {config['machine']['gpu'] or 'GPU'}s ({backend})" \
        if device.startswith("cuda") else \
        f"{world} ranks on a {config['machine']['cpus']}-core CPU machine ({backend})"
    dtype = str(config.get("dtype", "torch.float32")).removeprefix("torch.")
    if dtype != "float32":
        setting += f", {dtype}"
    return STEP.format(
        which=MODELS[config.get("model", "gpt")], model=model_summary(config),
        command=command(f"torchrun --nproc_per_node={world} benchmarks/step.py", config,
                        f"{device.split(':')[0].upper()}, {backend}: {duration(config)}"),
        setting=setting, rounds=config["rounds"], steps=config["steps"],
        provenance=provenance(config), table=step_table(result), speed=step_speed(result),
        figure=f"![Median step time and peak memory per rank, by category]({figure})\n\n"
        if figure else "",
        bytes_table=bytes_table(result), copies=step_copies(result),
        communication=step_communication(result),
        losses=step_losses(result["max_loss_difference_vs_fsdp2"]),
        memory=step_memory(memory, result["analytic"]["memory_bound"]),
        accelerator=step_accelerator(result, device),
    )


def step_table(result: dict) -> str:
    memory, bound = result["peak_memory"], result["analytic"]["memory_bound"]
    rows = []
    for name in CONTENDERS:
        vs_fsdp2 = f"{result['vs_fsdp2'][name]:.2f}"
        rows.append([name, f"{result['step_seconds'][name] * 1e3:.1f}",
                     f"**{vs_fsdp2}**" if name == "fsdp_compose" else vs_fsdp2,
                     f"{result['vs_floor'][name]:.2f}", kib(memory[name]["Total"]),
                     f"{memory[name]['Total'] / bound:.2f}"])
    header = ["", "step ms", "vs FSDP2", "vs floor", "peak memory / rank",
              "vs FSDP analytic bound"]
    extra = [(key, title, unit) for key, title, unit in EXTRA_COLUMNS if result.get(key)]
    for key, title, unit in extra:
        header.append(title)
        for row, name in zip(rows, CONTENDERS):
            value = result[key].get(name)
            row.append("" if value is None else unit(value))
    return table(header, "lrrrrr" + "r" * len(extra), rows)


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
            f"the floor's; DDP's takes {fsdp2['DDP']:.2f} × FSDP2's and {floor['DDP']:.2f} × "
            f"the floor's, and FSDP2's {floor['FSDP2']:.2f} × the floor's.")


def bytes_table(result: dict) -> str:
    comm, floor = result["communication"], result["analytic"]

    def cell(value: int | None) -> str:
        return "–" if value is None else f"{value:,}"

    columns = [(kind, what) for kind in ("all_gather", "reduce_scatter")
               for what in ("calls", "bytes")]
    rows = [[name, *(cell(comm[name][what].get(kind)) for kind, what in columns),
             cell(comm[name]["bytes"].get("all_reduce"))]
            for name in ("fsdp_compose", "FSDP2", "DDP") if name in comm]
    rows.append(["analytic floor", *(cell(floor[f"{kind}_{what}"]) for kind, what in columns),
                 f"{floor['ddp_all_reduce_bytes']:,} (DDP)"])
    return table(["", "all-gathers", "all-gathered B", "reduce-scatters", "reduce-scattered B",
                  "all-reduced B"], "lrrrrr", rows)


def copies_table(result: dict) -> str:
    """Bytes copied by op, per contender and the model's own, against the FSDP floor."""
    copies, floor = result["copies"], result["analytic"]
    own = copies["model"]["total_bytes"]
    kinds = sorted({kind for counted in copies.values() for kind in counted["bytes"]})
    rows = []
    for name in (*CONTENDERS, "model"):
        counted = copies[name]
        beyond = "" if name == "model" else f"{counted['total_bytes'] - own:,}"
        rows.append([name if name != "model" else "model's own",
                     *(f"{counted['bytes'].get(kind, 0):,}" for kind in kinds),
                     f"{counted['total_bytes']:,}", beyond])
    floors = [("FSDP floor", "copy_bytes"),
              ("floor, one reduce-scatter per unit", "copy_one_reduce_scatter_bytes")]
    rows += [[title, *("" for _ in kinds), "", f"{floor[key]:,}"]
             for title, key in floors if key in floor]
    return table(["", *(f"`{k}` B" for k in kinds), "total B", "beyond the model's own B"],
                 "l" + "r" * (len(kinds) + 2), rows)


def step_copies(result: dict) -> str:
    """The copies outside collectives against their floor; nothing for results without."""
    copies, floor = result.get("copies"), result["analytic"]
    if not copies:
        return ""
    ours, theirs = (copies[n]["total_bytes"] - copies["model"]["total_bytes"]
                    for n in ("fsdp_compose", "FSDP2"))
    casts = "" if not floor["copy_bytes"] else (
        f"; mixed precision adds the casts: each all-gather's input to param_dtype "
        f"({floor['copy_param_cast_bytes']:,} B) and the gradients to reduce_dtype "
        f"({floor['copy_grad_cast_bytes']:,} B)")
    eager = (" Under torch.compile the counted step runs eagerly (dynamo skips frames while "
             "a dispatch mode is active).") if result["config"].get("compile") else ""
    return COPIES.format(eager=eager, floor=floor["copy_bytes"], casts=casts, ours=ours,
                         theirs=theirs, table=copies_table(result),
                         vs_fsdp2=f"{ours / theirs:.2f} ×" if theirs else "against")


def step_communication(result: dict) -> str:
    comm, floor = result["communication"], result["analytic"]
    ours = comm["fsdp_compose"]
    calls, sent = ours["calls"], ours["bytes"]
    said = (f"Per step fsdp_compose issues {calls.get('all_gather', 0)} all-gathers "
            f"({sent.get('all_gather', 0):,} B) and {calls.get('reduce_scatter', 0)} "
            f"reduce-scatters ({sent.get('reduce_scatter', 0):,} B)")
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
                f"{kib(abs(theirs - ours))} {'below' if ours < theirs else 'above'} FSDP2's "
                f"{kib(theirs)}")
    return said + f", {ours / bound:.2f} of the bound ({kib(bound)})."


def step_accelerator(result: dict, device: str) -> str:
    if not device.startswith("cuda"):
        return ("On a GPU the same command runs on NCCL (e.g. with `--dtype bfloat16`) and also "
                "reports MFU (with `--peak-tflops`) and, from the profiler, the fraction of "
                "communication time hidden under compute; this run had no GPU, so it has "
                "neither.")
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

    memory, bound, config = result["peak_memory"], result["analytic"]["memory_bound"], \
        result["config"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bars = left.bar(CONTENDERS, [result["step_seconds"][n] * 1e3 for n in CONTENDERS])
    left.bar_label(bars, fmt="%.1f", fontsize=8)
    left.set_ylabel("median step (ms)")
    bottom = [0.0] * len(CONTENDERS)
    for category in (c for c in next(iter(memory.values())) if c != "Total"):
        values = [memory[n].get(category, 0) / 1024 for n in CONTENDERS]
        if any(values):
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


# CPU time per unit (benchmarks/overhead.py)

BY_HAND = "by hand"  # benchmarks/handwritten.py's variant in overhead.json
# The machine the CPU-overhead goal was set on: FSDP2's cost per unit there, and the goal.
# They are not this run's figures (this run's FSDP2 figure is set against them).
REFERENCE_FSDP2_US = 580.0
GOAL_US = 100.0

OVERHEAD = """\
## CPU time per unit

CPU time per unit per forward + backward, in one process with the fake process group
(W={world}, {units} × `Linear({dim}, {dim})`, batch {batch}: step time minus the unsharded
model's, divided by {units}), and the part of it spent inside the process group's all-gather and
reduce-scatter calls, timed in separate rounds; the rest is the runtime's own:

```bash
{commands}
```

{provenance}

{table}

{spread}{goal}{traced}{by_hand}

{calls} The fake group still copies every rank's shard into the gathered output{copies}{gloo}
Next come a skeleton of the same hooks (pre/post-forward, a pre-hook on the output's node, a
hook on each parameter's gradient accumulation) and the unit's tensor work: copying the gathered
rows out, chunking the gradients in, and allocating and freeing buffers. A unit's shards live in
one flat tensor, which its one all-gather sends as is; the all-gather's output and the
reduce-scatter's input are reused tensors, shaped once, whose storage is resized per use; the
parameters share one unsharded storage, into which one `split_with_sizes_copy` copies the
gathered rows; a unit whose parameters all train learns that its backward is done from hooks on
their gradient accumulation, registered once, rather than from a view of each input with a node
hook made at every forward (which costs more, and which units with frozen parameters still pay);
a unit swaps the registrations of all its parameters with one dict update per owning module, and
checks them for replaced or frozen parameters once per iteration rather than per gather; a module
carries two hooks (one post-forward hook, called also when forward raised, undoes a failed
forward), called without a wrapper; the collectives are issued with options, group sizes and
dtypes decided once, not asked of the group or the tensors per call (in this setting every touch
of a cold Python object or tensor costs tenths of a microsecond); and reduced gradient shards are
added with one op to `.grad`s that are still views of an earlier reduction. The rest is
bookkeeping in Python.
{blocks}"""


def overhead_section(results: dict) -> str:
    fake, gloo = results.get("fake"), results.get("gloo")
    first = fake or gloo
    config = first["config"]
    commands, lines = [], []
    for result, comment, title in (
            (fake, f"fake process group, W={config['world_size']}", "Fake process group"),
            (gloo, "one gloo rank: no communication at all", "One gloo rank")):
        if result:
            c = result["config"]
            commands.append(command("python benchmarks/overhead.py", c, comment))
            lines.append(f"{title}: median of {c['repeats']} rounds of {c['steps']} steps "
                         f"({provenance(c)}).")
    return OVERHEAD.format(
        world=config["world_size"] if fake else 8, units=config["units"], dim=config["dim"],
        batch=config["batch"], commands="\n".join(commands), provenance="\n".join(lines),
        table=overhead_table(fake, gloo), spread=overhead_spread(fake),
        goal=overhead_goal(fake), calls=overhead_calls(first),
        copies=" (a copy per rank)" if fake else "",
        gloo=overhead_gloo(fake, gloo), traced=overhead_traced(fake),
        by_hand=overhead_by_hand(fake), blocks=overhead_blocks(results),
    )


def overhead_table(fake: dict | None, gloo: dict | None) -> str:
    labels = {"fsdp_compose": "fsdp_compose", "torch fully_shard": "torch's fully_shard"}
    if all(BY_HAND in r["variants"] for r in (fake, gloo) if r):
        labels[BY_HAND] = BY_HAND
    rows = [[label] for label in labels.values()] + [["ratio"]]
    header, align = [""], "l"
    if fake:
        v = fake["variants"]
        header += [f"fake, W={fake['config']['world_size']}", "in collectives", "runtime's own"]
        align += "rrr"
        for row, name in zip(rows, labels):
            row += [us(v[name][key]) for key in
                    ("us_per_unit", "collectives_us_per_unit", "runtime_us_per_unit")]
        rows[-1] += [f"{ratio(v, 'us_per_unit'):.3f}", "",
                     f"{ratio(v, 'runtime_us_per_unit'):.2f}"]
    if gloo:
        v = gloo["variants"]
        header.append("gloo, 1 rank")
        align += "r"
        for row, name in zip(rows, labels):
            row.append(us(v[name]["us_per_unit"]))
        rows[-1].append(f"{ratio(v, 'us_per_unit'):.2f}")
    return table(header, align, rows)


def ratio(variants: dict, key: str) -> float:
    return variants["fsdp_compose"][key] / variants["torch fully_shard"][key]


def overhead_spread(fake: dict | None) -> str:
    """The ratio of each interleaved round (each round's own unsharded step subtracted)."""
    if not fake:
        return ""
    v = fake["variants"]
    rounds = zip(v["fsdp_compose"]["step_samples"], v["torch fully_shard"]["step_samples"],
                 v["unsharded"]["step_samples"])
    ratios = [(ours - floor) / (theirs - floor) for ours, theirs, floor in rounds]
    cpus = fake["config"].get("machine", {}).get("cpus")
    where = f"On this {cpus}-core machine, across" if cpus else "Across"
    return (f"{where} the {len(ratios)} rounds of this run the ratio on the fake group ranges "
            f"from {min(ratios):.3f} to {max(ratios):.3f}. ")


def overhead_goal(fake: dict | None) -> str:
    """Against the machine the goal was set on, where the setting was the default one."""
    if not fake:
        return ""
    c = fake["config"]
    if (c["world_size"], c["units"], c["dim"], c["batch"]) != (8, 64, 64, 8):
        return ""
    v = fake["variants"]
    theirs, r = v["torch fully_shard"]["us_per_unit"], ratio(v, "us_per_unit")
    goal = GOAL_US / REFERENCE_FSDP2_US
    return (f"FSDP2's figure here is {theirs / REFERENCE_FSDP2_US:.1f} times the "
            f"{REFERENCE_FSDP2_US:.0f} µs it costs on the machine where the goal of "
            f"{GOAL_US:.0f} µs per unit was set, so that goal is a ratio of about {goal:.3f}; "
            f"fsdp_compose's {r:.3f} is about {r * REFERENCE_FSDP2_US:.0f} µs there, "
            f"{'within' if r <= goal else 'above'} the goal.")


def overhead_by_hand(fake: dict | None) -> str:
    """The design's floor: the same work done by hand, against both runtimes."""
    if not fake or BY_HAND not in fake["variants"]:
        return ""
    v = fake["variants"]
    hand, ours = v[BY_HAND]["us_per_unit"], v["fsdp_compose"]["us_per_unit"]
    theirs = v["torch fully_shard"]["us_per_unit"]
    added = (f"fsdp_compose's checks, state and features add {us(ours - hand)} "
             f"({(ours - hand) / hand:.0%}) over it." if ours > hand else
             "fsdp_compose measured no more than it in this run.")
    return (f"\n\nThe row \"by hand\" is a unit's work written out with nothing else "
            f"(`benchmarks/handwritten.py`: the same all-gathers and copy-out, hooks, "
            f"`_chunk_cat` and reduce-scatter; its gradients are checked equal to fsdp_compose's "
            f"before the timing). It costs {us(hand)} per unit, {hand / theirs:.3f} of FSDP2's: "
            f"what the work of this design costs on this machine with no runtime around it, "
            f"about the least a runtime built on these hooks and collectives can cost. {added}")


def overhead_traced(fake: dict | None) -> str:
    """The model that ran one step under a StepTrace before the timing, against the other."""
    if not fake or "after a StepTrace" not in fake["variants"]:
        return ""
    v = fake["variants"]
    traced, untraced = v["after a StepTrace"]["us_per_unit"], v["fsdp_compose"]["us_per_unit"]
    return (f" A second fsdp_compose model that ran one step under a `StepTrace` first costs "
            f"{us(traced)} per unit against {us(untraced)}: closed, a trace leaves nothing "
            "behind (a model never traced runs no tracing code at all).")


def overhead_calls(result: dict) -> str:
    v = result["variants"]
    ours, theirs = v["fsdp_compose"]["calls_per_unit"], v["torch fully_shard"]["calls_per_unit"]
    if ours == theirs == 3:
        return ("Both runtimes make the same three calls per unit (an all-gather in forward and "
                "in backward, a reduce-scatter).")
    return (f"fsdp_compose makes {ours:g} calls per unit into the process group, torch's "
            f"fully_shard {theirs:g}.")


def overhead_gloo(fake: dict | None, gloo: dict | None) -> str:
    if not (fake and gloo):
        return "."
    ours = fake["variants"]["fsdp_compose"]
    saved = ours["us_per_unit"] - gloo["variants"]["fsdp_compose"]["us_per_unit"]
    inside = ours["collectives_us_per_unit"]
    if saved > inside:
        return (f", and that work also evicts the caches the rest of the step runs in: removing "
                f"the collectives altogether (the one-rank gloo column) saves about {us(saved)} "
                f"of fsdp_compose's figure, more than the {us(inside)} spent inside them.")
    return (f": removing the collectives altogether (the one-rank gloo column) saves about "
            f"{us(saved)} of fsdp_compose's figure, against {us(inside)} timed inside them.")


def overhead_blocks(results: dict) -> str:
    """The runs with other units or an optimizer step (overhead.py --block, --optimizer),
    kept in overhead.json beside the default's: one column each."""
    runs = [r for key, r in results.items() if key not in ("fake", "gloo")]
    if not runs:
        return ""
    names = ("fsdp_compose", "torch fully_shard", BY_HAND)
    header, rows = [""], [[name] for name in ("fsdp_compose", "torch's fully_shard", BY_HAND)]
    rows.append(["ratio"])
    commands = []
    for run in runs:
        c, v = run["config"], run["variants"]
        unit = "Linear" if c.get("block", "linear") == "linear" else "transformer block"
        header.append(f"{c['units']} × {unit}{' + AdamW' if c.get('optimizer') else ''}")
        for row, name in zip(rows, names):
            row.append(us(v[name]["us_per_unit"]) if name in v else "–")
        rows[-1].append(f"{ratio(v, 'us_per_unit'):.3f}")
        commands.append(command("python benchmarks/overhead.py", c,
                                f"{c['backend']}, W={c['world_size']}"))
    first = runs[0]["config"]
    blocks = (f" on pre-norm transformer blocks of 12 parameters (LayerNorm, fused qkv and "
              f"output projections, LayerNorm, a 4 × MLP, all with biases; dim {first['dim']}, "
              f"seq {first.get('seq', '?')})"
              if any(r["config"].get("block") == "transformer" for r in runs) else "")
    adamw = (", with \"+ AdamW\" a foreach AdamW step in every contender's step, the unsharded "
             "model's included (which steps W times the elements the shards do)"
             if any(r["config"].get("optimizer") for r in runs) else "")
    return (f"\nA real model's units hold more parameters than a Linear's two. The same measure "
            f"(median of {first['repeats']} rounds of {first['steps']} steps, "
            f"{provenance(first)}){blocks}{adamw}:\n\n```bash\n" + "\n".join(commands)
            + "\n```\n\n" + table(header, "l" + "r" * len(runs), rows) + "\n")


# Scale (benchmarks/scale.py)

SHARDED = ("fsdp_compose", "FSDP2")

SCALE = """\
## Scale

The same GPT at {world_range} ranks, one rank of each simulated in one process on the fake
process group (its collectives fill their outputs without other processes): per-rank peak memory
and bytes per step for both runtimes, against the analytic figures, and the CPU time of a step
(`--worlds`, `--rank` and the model's sizes are options):

```bash
{command}
```

GPT of {depth} blocks, dim {dim}, seq {seq}, batch {batch}, rank {rank}, median of {steps} steps
per size ({provenance}):

{table}

{floors} The figures also show what padding costs: every parameter is padded to W shards on dim
0, so once W passes a dimension (this model's largest is {largest_rows} rows) each rank keeps one
padded row of it, the buffers grow towards W rows per parameter, and the shards stop
shrinking.{padding} {times}
"""


def scale_section(data: dict) -> str:
    config, worlds = data["config"], data["worlds"]
    sizes = [r["world_size"] for r in worlds]
    same_peak = [r["peak_memory"]["fsdp_compose"]["Total"] == r["peak_memory"]["FSDP2"]["Total"]
                 for r in worlds]
    at_floors = [at_floor(r["communication"]["fsdp_compose"], r["analytic"])
                 and r["communication"]["fsdp_compose"] == r["communication"]["FSDP2"]
                 for r in worlds]
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
        floors += (f"; at W = {joined(off)} fsdp_compose does not send exactly the analytic "
                   "floor or not what FSDP2 sends (the buffers' bytes; a ring sends (W-1)/W of "
                   "each per rank).")
    comment = f"W = {', '.join(map(str, sizes))}: {duration(config)}"
    return SCALE.format(
        world_range=f"{sizes[0]} to {sizes[-1]}" if len(sizes) > 1 else str(sizes[0]),
        command=command("python benchmarks/scale.py", config, comment), **config,
        provenance=provenance(config), table=scale_table(worlds), floors=floors,
        padding=scale_padding(worlds), times=scale_times(worlds, config))


def scale_table(worlds: list[dict]) -> str:
    rows = []
    for r in worlds:
        ours, theirs = (r["peak_memory"][n]["Total"] for n in SHARDED)
        floor, sent = r["analytic"], r["communication"]["fsdp_compose"]
        rows.append([str(r["world_size"]), kib(ours), kib(theirs),
                     f"{ours / floor['memory_bound']:.2f}",
                     f"{sent['bytes'].get('all_gather', 0):,} B",
                     f"{sent['bytes'].get('reduce_scatter', 0):,} B",
                     "yes" if at_floor(sent, floor) else "**no**",
                     *(f"{r['step_seconds'][n] * 1e3:.1f}" for n in SHARDED)])
    return table(["W", "peak / rank", "FSDP2", "vs bound", "all-gathered", "reduce-scattered",
                  "= floor", "step ms", "FSDP2"], "rrrrrrcrr", rows)


def scale_padding(worlds: list[dict]) -> str:
    if len(worlds) < 2:
        return ""
    gathered = [r["communication"]["fsdp_compose"]["bytes"].get("all_gather", 0) for r in worlds]
    peaks = [r["peak_memory"]["fsdp_compose"]["Total"] for r in worlds]
    sizes = [r["world_size"] for r in worlds]
    said = ""
    flat = [w for w, b in zip(sizes, gathered) if b == gathered[0]]
    if gathered[-1] > gathered[0]:
        said += (f" Here the all-gathered bytes stay at {gathered[0]:,} B up to W = {flat[-1]} "
                 f"and reach {gathered[-1]:,} B ({gathered[-1] / gathered[0]:.1f} ×) at "
                 f"W = {sizes[-1]}")
    lowest = min(range(len(peaks)), key=peaks.__getitem__)
    if lowest < len(peaks) - 1:
        said += ("; " if said else " Here ") + (
            f"the peak per rank is lowest at W = {sizes[lowest]} ({kib(peaks[lowest])}) and "
            f"{kib(peaks[-1])} at W = {sizes[-1]}")
    return said + "." if said else ""


def scale_times(worlds: list[dict], config: dict) -> str:
    ratios = [r["step_seconds"]["fsdp_compose"] / r["step_seconds"]["FSDP2"] for r in worlds]
    said = (f"The step times (median of {config['steps']}, most of them the fake group "
            f"filling its buffers) put fsdp_compose at {min(ratios):.2f}"
            + (f" to {max(ratios):.2f}" if len(ratios) > 1 else "") + " × FSDP2's")
    samples = worlds[-1].get("step_samples", {})
    spreads = [max(abs(s - statistics.median(t)) for s in t) / statistics.median(t)
               for t in samples.values() if len(t) > 1]
    if spreads:
        said += (f"; at W = {worlds[-1]['world_size']} a runtime's timed steps lie within "
                 f"±{max(spreads) * 100:.0f} % of their median, so small differences there are "
                 "noise")
    return said + "."


# The optimizer step (benchmarks/optimizer.py)

OPTIMIZER = """\
## The optimizer step

AdamW's step alone, ms, over the sharded parameters of 8 blocks (dim {dims}, 12 parameters each)
on a fake group of {world}, under each mixed-precision policy (what the parameters are stored in
does not change: float32), median of {rounds} interleaved rounds; "plain" steps ordinary tensors
holding the same local shards and gradients:

```bash
python benchmarks/optimizer.py
```

{provenance}

{table}

AdamW over fsdp_compose's parameters does its arithmetic on their local tensors while everything
else sees the DTensors (docs/design.md, "The optimizer step on local shards"): it costs
{plain_gap} the plain tensors' time and {ours_vs_fsdp2} FSDP2's, whose step pays DTensor's
dispatch on every op (the for-loop per parameter and op, foreach and fused once per op over all
parameters). What is left over plain tensors is torch's own loop over the parameters reading
DTensors (their `.grad` and state) and the unwrapping of the lists handed to the arithmetic:
about 0.1 ms per 96 parameters, most visible beside the fused kernel."""
OPTIMIZED = ("fsdp_compose", "FSDP2", "plain")


def optimizer_rows(result: dict) -> list[tuple[str, str, str, dict[str, float]]]:
    """(dim, policy, AdamW variant, ms per contender) of each measured setting."""
    return [(dim.removeprefix("dim "), policy, variant, ms)
            for dim, steps in result["ms_per_step"].items()
            for policy, by_variant in steps.items() for variant, ms in by_variant.items()]


def optimizer_table(result: dict) -> str:
    rows = [[dim, policy, variant, *(f"{ms[c]:.2f}" for c in OPTIMIZED),
             f"{ms['fsdp_compose'] / ms['plain']:.2f}", f"{ms['fsdp_compose'] / ms['FSDP2']:.2f}"]
            for dim, policy, variant, ms in optimizer_rows(result)]
    return table(["dim", "policy", "AdamW", *OPTIMIZED, "fsdp_compose / plain",
                  "fsdp_compose / FSDP2"], "lllrrrrr", rows)


def optimizer_section(result: dict) -> str:
    config, every = result["config"], [ms for *_, ms in optimizer_rows(result)]

    def ratio_range(versus: str) -> str:
        values = [ms["fsdp_compose"] / ms[versus] for ms in every]
        return f"{min(values):.2f}–{max(values):.2f} ×"

    return OPTIMIZER.format(
        dims=" and ".join(dim.removeprefix("dim ") for dim in result["ms_per_step"]),
        world=config["world"], rounds=config["rounds"], provenance=provenance(config),
        table=optimizer_table(result), ours_vs_fsdp2=ratio_range("FSDP2"),
        plain_gap=ratio_range("plain"),
    )


# Whole checkpoints (benchmarks/full_state_dict.py)

FULL_STATE_DICT = """\
## Whole checkpoints

Rank 0's peak memory while writing a whole checkpoint of a sharded model: `save_full_state_dict`
(safetensors, a tensor gathered and written at a time) against torch.distributed.checkpoint's
`get_model_state_dict(full_state_dict=True, cpu_offload=True)` followed by safetensors'
`save_file` (the whole state dict on rank 0). The figure is the resident set's peak above what
rank 0 held before, float32 weights:

```bash
{command}
```

{ranks} gloo ranks ({provenance}):

{table}

Streaming holds about one tensor at a time, whatever the model's size: twice the largest tensor
here, as gloo's all-gather stages its output; the whole-state-dict way holds the whole model and
more.
"""


def full_state_dict_table(result: dict) -> str:
    rows = []
    for name, row in result["models"].items():
        streamed = row["save_full_state_dict"]["peak_extra_mib"]
        dcp = row["DCP full state dict"]["peak_extra_mib"]
        rows.append([name, f"{row['whole_mib']:.1f} MiB", f"{row['largest_tensor_mib']:.1f} MiB",
                     f"{streamed:.1f} MiB", f"{dcp:.1f} MiB", f"**{streamed / dcp:.2f}**"])
    return table(["model", "weights", "largest tensor", "streamed", "DCP full state dict",
                  "ratio"], "lrrrrr", rows)


def full_state_dict_section(result: dict) -> str:
    config = result["config"]
    return FULL_STATE_DICT.format(
        command=command("torchrun --nproc_per_node=2 benchmarks/full_state_dict.py", config,
                        "CPU, gloo"),
        ranks=config["world_size"], provenance=provenance(config),
        table=full_state_dict_table(result))


# Weights out and in (benchmarks/weights.py)

WEIGHTS = """\
## Weights out and in

A sharded model's weights whole, as an RL trainer sends them to an inference engine:
`iter_full_state_dict` (one all-gather per unit, or per piece of a unit past its largest tensor
and 4 MiB) against a loop of `full_tensor()` (one per tensor) and DCP's
`get_model_state_dict(full_state_dict=True, cpu_offload=True)`; and back in, whole tensors
streamed into `load_full_state_dict(model, pairs)` against DCP's
`set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)` (all of them at once on
rank 0). Peak: tensor memory above what was live (torch's MemTracker), each tensor dropped as it
arrives:

```bash
torchrun --nproc_per_node=2 benchmarks/weights.py
```

{ranks} gloo ranks ({provenance}):

{table}

With many small tensors, one gather per unit takes {small} the loop's time; with few large ones,
each goes alone and the peak stays one tensor.
"""
LOOP = "out: full_tensor() loop"


def weights_table(result: dict) -> str:
    rows = []
    for model, ways in result["results"].items():
        for way, r in ways.items():
            versus = f"{r['ms'] / ways[LOOP]['ms']:.2f}" if way.startswith("out") else ""
            rows.append([model, way, f"{r['ms']:.1f}", versus, f"{r['collectives']:.0f}",
                         f"{r['peak MiB']:.2f} MiB"])
    return table(["model", "way", "ms", "vs the loop", "collectives", "peak"], "llrrrr", rows)


def weights_section(result: dict) -> str:
    small = result["results"]["many small"]
    versus = small["out: iter_full_state_dict"]["ms"] / small[LOOP]["ms"]
    return WEIGHTS.format(ranks=result["config"]["world"], provenance=provenance(result["config"]),
                          table=weights_table(result), small=f"{versus:.2f} ×")


# The page

HEADER = """\
# Performance

<!-- Generated by benchmarks/report.py from {sources}: edit the templates in
benchmarks/report.py, not this file, and run the benchmarks and the report again. -->

Every figure on this page is read from the benchmarks' output; after running them,
`python benchmarks/report.py` writes this page and its chart again:

```bash
torchrun --nproc_per_node=2 benchmarks/step.py   # step.json
python benchmarks/overhead.py                    # overhead.json, fake process group
python benchmarks/overhead.py --backend gloo     # overhead.json, one gloo rank
python benchmarks/scale.py                       # scale.json
torchrun --nproc_per_node=2 benchmarks/full_state_dict.py   # full_state_dict.json
python benchmarks/optimizer.py                   # optimizer.json
torchrun --nproc_per_node=2 benchmarks/weights.py   # weights.json
python benchmarks/report.py                      # docs/performance.md and performance.png
```
{missing}"""

BENCHMARKS = {  # name: the command that writes its JSON
    "step": "torchrun --nproc_per_node=2 benchmarks/step.py",
    "overhead": "python benchmarks/overhead.py, and with --backend gloo",
    "scale": "python benchmarks/scale.py",
    "full_state_dict": "torchrun --nproc_per_node=2 benchmarks/full_state_dict.py",
    "optimizer": "python benchmarks/optimizer.py",
    "weights": "torchrun --nproc_per_node=2 benchmarks/weights.py",
}
# In the page's order; the step's section takes the chart as well.
SECTIONS: dict[str, Callable[[dict], str]] = {
    "overhead": overhead_section, "scale": scale_section, "optimizer": optimizer_section,
    "full_state_dict": full_state_dict_section, "weights": weights_section,
}


def reflow(text: str, width: int = 92) -> str:
    """Wrap each paragraph of prose to `width` (the templates' lines and the figures put into
    them wrap as one); code blocks, tables, images and comments stay as they are."""
    blocks, fenced = [], False
    for block in text.split("\n\n"):
        fences = block.count("```")
        keep = fenced or fences or block.lstrip().startswith(("|", "!", "<!--", "#"))
        if fences % 2:
            fenced = not fenced
        if keep:
            blocks.append(block)
            continue
        # Code spans, figures with their units and "W = 8" stay on one line: their spaces
        # are hidden from the wrapping.
        prose = re.sub(r"`[^`]*`|\d (?:B|KiB|µs|%|×)(?!\w)|W = \d",
                       lambda m: m[0].replace(" ", "\0"), " ".join(block.split()))
        wrapped = textwrap.fill(prose, width, break_long_words=False, break_on_hyphens=False)
        blocks.append(wrapped.replace("\0", " "))
    return "\n\n".join(blocks)


def render(found: dict, missing: list[str], results: Path, figure: str | None) -> str:
    gaps = "" if not missing else "\nNot on this page yet: " + "; ".join(
        f"{name} (no `{results / name}.json`: `{BENCHMARKS[name]}`)" for name in missing) + ".\n"
    sources = ", ".join(f"{results / n}.json" for n in found)
    sections = [HEADER.format(sources=sources, missing=gaps)]
    if "step" in found:
        sections.append(step_section(found["step"], figure))
    overhead = found.get("overhead", {})
    if not (overhead.get("fake") or overhead.get("gloo")):
        found = {name: result for name, result in found.items() if name != "overhead"}
    sections += [section(found[name]) for name, section in SECTIONS.items() if name in found]
    # Each section a paragraph of its own: one ending in prose would join the next heading.
    return reflow("\n".join(s.rstrip("\n") + "\n" for s in sections)).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"),
                        help="where the benchmarks wrote their JSON")
    parser.add_argument("--out", type=Path, default=Path("docs"),
                        help="where performance.md and performance.png go")
    args = parser.parse_args(argv)
    paths = {name: args.results / f"{name}.json" for name in BENCHMARKS}
    found = {name: json.loads(path.read_text()) for name, path in paths.items() if path.exists()}
    missing = [name for name in BENCHMARKS if name not in found]
    for name in missing:
        print(f"missing {paths[name]}: no {name} section ({BENCHMARKS[name]})")
    if not found:
        parser.error(f"no results in {args.results}: run the benchmarks first")
    for backend in ("fake", "gloo"):
        if "overhead" in found and backend not in found["overhead"]:
            print(f"missing the {backend} backend in {paths['overhead']}: no {backend} column "
                  f"(python benchmarks/overhead.py --backend {backend})")
    args.out.mkdir(parents=True, exist_ok=True)
    png, page = args.out / "performance.png", args.out / "performance.md"
    figure = None
    if "step" in found:
        if plot_step(found["step"], png):
            figure = png.name
        else:
            print(f"matplotlib not installed: {page} without its chart (pip install matplotlib)"
                  + (f"; {png} left as it was, unlinked" if png.exists() else ""))
    page.write_text(render(found, missing, args.results, figure))
    print(f"wrote {page}" + (f" and {png}" if figure else ""))


if __name__ == "__main__":
    main()
