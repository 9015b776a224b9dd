"""docs/performance.md and its chart (performance.png, with matplotlib) from the benchmarks'
JSON in benchmarks/results/: every figure on the page comes from the results; a missing result
leaves its section out. No torch here: the benchmarks print these tables too."""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
from datetime import datetime
from pathlib import Path

RESULTS = ("step", "overhead", "scale", "optimizer", "full_state_dict", "weights")  # in order
COMMANDS = """\
```bash
torchrun --nproc_per_node=2 benchmarks/step.py   # step.json
python benchmarks/overhead.py                    # overhead.json, fake process group
python benchmarks/overhead.py --backend gloo     # overhead.json, one gloo rank
python benchmarks/scale.py                       # scale.json
torchrun --nproc_per_node=2 benchmarks/full_state_dict.py   # full_state_dict.json
python benchmarks/optimizer.py                   # optimizer.json
torchrun --nproc_per_node=2 benchmarks/weights.py   # weights.json
python benchmarks/report.py                      # docs/performance.md and performance.png
```"""
CONTENDERS, SHARDED = ("fsdp_compose", "FSDP2", "DDP", "floor"), ("fsdp_compose", "FSDP2")
# overhead.json's variants, as the page names them. The goal of 100 µs per unit was set on a
# machine where FSDP2 cost 580 µs per unit: the goal is a ratio to FSDP2.
VARIANTS = {"fsdp_compose": "fsdp_compose", "torch fully_shard": "torch's fully_shard",
            "by hand": "by hand"}
REFERENCE_FSDP2_US, GOAL_US = 580.0, 100.0
SAVE, DCP, LOOP = "save_full_state_dict", "DCP full state dict", "out: full_tensor() loop"


def table(header: list[str], align: str, rows: list[list]) -> str:
    """`align`: l, r or c per column; a cell None shows "–", an int thousands separators."""
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    rows = [["–" if c is None else f"{c:,}" if isinstance(c, int) else c for c in row]
            for row in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def us(x: float) -> str:
    return f"{x:,.0f} µs"


def provenance(config: dict) -> str:
    machine, date = config["machine"], datetime.fromisoformat(config["date"])
    gpu = f"{machine['gpu']}, " if machine["gpu"] else ""
    return (f"{date:%Y-%m-%d %H:%M} UTC, torch {config['torch']}, Python {config['python']}, "
            f"{gpu}{machine['cpu']} ({machine['cpus']} cores), {machine['platform']}")


def command(prefix: str, config: dict, comment: str) -> str:
    return f"{prefix} {' '.join(config['argv'])}".rstrip().ljust(48) + f" # {comment}"


def section(title: str, prose: str, command: str, run: str, *blocks: str) -> list[str]:
    """A section as every one goes: its heading, what it measures, the command, the run, tables."""
    return [f"## {title}", prose, f"```bash\n{command}\n```", run, *blocks]


def duration(config: dict) -> str:
    seconds = config["wall_seconds"]
    return f"{seconds:.0f} s" if seconds < 100 else f"about {seconds / 60:.0f} minutes"


def at_floor(comm: dict, floor: dict) -> bool:
    """Whether a runtime's collectives (calls and bytes) are the analytic floor's."""
    return all(comm[what] == {kind: floor[f"{kind}_{what}"] for kind in
                              ("all_gather", "reduce_scatter")} for what in ("calls", "bytes"))


# The training step's columns that only GPU runs have (MFU, hidden communication) are left out
# where the result has none.
EXTRA = (("host_seconds", "host ms", lambda s: f"{s * 1e3:.1f}"), ("mfu", "MFU", "{:.3f}".format),
         ("hidden_communication", "comm. hidden", "{:.3f}".format),
         ("max_loss_difference_vs_fsdp2", "loss vs FSDP2", "{:.3g}".format))


def step_table(result: dict) -> str:
    memory, bound = result["peak_memory"], result["analytic"]["memory_bound"]
    extra = [column for column in EXTRA if result[column[0]]]
    rows = [[name, f"{result['step_seconds'][name] * 1e3:.1f}",
             "**{:.2f}**".format(result["vs_fsdp2"][name]) if name == "fsdp_compose"
             else f"{result['vs_fsdp2'][name]:.2f}", f"{result['vs_floor'][name]:.2f}",
             kib(memory[name]["Total"]), f"{memory[name]['Total'] / bound:.2f}",
             *("" if result[key].get(name) is None else unit(result[key][name])
               for key, _, unit in extra)] for name in CONTENDERS]
    return table(["", "step ms", "vs FSDP2", "vs floor", "peak memory / rank",
                  "vs FSDP analytic bound", *(title for _, title, _ in extra)],
                 "l" + "r" * (5 + len(extra)), rows)


def bytes_table(result: dict) -> str:
    comm, floor = result["communication"], result["analytic"]
    keys = [(kind, what) for kind in ("all_gather", "reduce_scatter")
            for what in ("calls", "bytes")]
    rows = [[name, *(comm[name][what].get(kind) for kind, what in keys),
             comm[name]["bytes"].get("all_reduce")] for name in ("fsdp_compose", "FSDP2", "DDP")]
    rows.append(["analytic floor", *(floor[f"{kind}_{what}"] for kind, what in keys),
                 f"{floor['ddp_all_reduce_bytes']:,} (DDP)"])
    return table(["", "all-gathers", "all-gathered B", "reduce-scatters", "reduce-scattered B",
                  "all-reduced B"], "lrrrrr", rows)


def copies_table(result: dict) -> str:
    copies, floor = result["copies"], result["analytic"]
    own = copies["model"]["total_bytes"]
    kinds = sorted({kind for counted in copies.values() for kind in counted["bytes"]})
    rows = [[name.replace("model", "model's own"),
             *(copies[name]["bytes"].get(kind, 0) for kind in kinds), copies[name]["total_bytes"],
             "" if name == "model" else copies[name]["total_bytes"] - own]
            for name in (*CONTENDERS, "model")]
    rows += [[title, *("" for _ in kinds), "", floor[key]] for title, key in (
        ("FSDP floor", "copy_bytes"),
        ("floor, one reduce-scatter per unit", "copy_one_reduce_scatter_bytes"))]
    return table(["", *(f"`{k}` B" for k in kinds), "total B", "beyond the model's own B"],
                 "l" + "r" * (len(kinds) + 2), rows)


def step_section(result: dict, figure: str | None) -> list[str]:
    config, comm, floor = result["config"], result["communication"], result["analytic"]
    world, device, backend = config["world_size"], config["device"], config["backend"]
    dtype = config["dtype"].removeprefix("torch.").replace("float32", "")
    return section(
        "Training step",
        ("The Llama of `benchmarks/harness.py`" if config["model"] == "llama" else
         "The GPT of `examples/train_gpt.py`") + f" ({config['depth']} blocks, dim "
        f"{config['dim']}, seq {config['seq']}, batch {config['batch']} per rank, AdamW"
        + (", bfloat16 mixed precision (autocast for DDP and the floor)"
           if config["mixed_precision"] else "")
        + (f", each block compiled ({config['compile_backend']})" if config["compile"] else "")
        + ") under fsdp_compose, torch's fully_shard (FSDP2), DDP and a single-process floor (the "
        "plain model on each rank's batch), interleaved in rounds. Peak memory is torch's "
        f"`MemTracker`'s, against the analytic bound of {kib(floor['memory_bound'])}: sharded "
        "parameters, gradients and AdamW state, the root, three block-sized buffers and the "
        "floor's activations at its peak. \"loss vs FSDP2\" is the largest difference from "
        "FSDP2's loss over the timed steps:",
        command(f"torchrun --nproc_per_node={world} benchmarks/step.py", config,
                f"{device.split(':')[0].upper()}, {backend}: {duration(config)}"),
        (f"{world} ranks on {config['machine']['gpu'] or 'GPU'}s ({backend}"
         if device.startswith("cuda") else
         f"{world} ranks on a {config['machine']['cpus']}-core CPU machine ({backend}")
        + f"{dtype and ', '}{dtype}), median of {config['rounds']} rounds of {config['steps']} "
        f"steps ({provenance(config)}):",
        step_table(result),
        *([f"![Median step time and peak memory per rank, by category]({figure})"] * bool(figure)),
        "Collectives per step, counted at dispatch, against the analytic floor of an all-gather "
        "per unit and pass (the root's parameters stay gathered from forward to backward) and a "
        "reduce-scatter per unit; DDP all-reduces from C++, unseen: its figure is the gradients'. "
        f"fsdp_compose sends {'exactly' if at_floor(comm['fsdp_compose'], floor) else 'not'} the "
        f"floor; FSDP2 {'the same' if comm['FSDP2'] == comm['fsdp_compose'] else 'not'}.",
        bytes_table(result),
        "Bytes copied outside the collectives per step and rank, counted at dispatch by op, with "
        "the plain model's own copies in the FSDPs' dtype (\"model's own\")"
        + (", eagerly (dynamo skips frames under a dispatch mode)" if config["compile"] else "")
        + ". A zero-copy FSDP copies nothing more (the FSDP floor)"
        + (f" but mixed precision's casts, of the all-gathers' inputs "
           f"({floor['copy_param_cast_bytes']:,} B) and the gradients "
           f"({floor['copy_grad_cast_bytes']:,} B)" if floor["copy_bytes"] else "")
        + "; one reduce-scatter per unit copies each gradient into its input once.",
        copies_table(result),
        "On a GPU the step table adds MFU (with `--peak-tflops`) and \"comm. hidden\", the share "
        "of communication time hidden under compute (from the profiler).")


def plot_step(result: dict, path: Path) -> bool:
    """The step times and peak memory by category; False, writing nothing, without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory, config = result["peak_memory"], result["config"]
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
    right.axhline(result["analytic"]["memory_bound"] / 1024, color="black", linestyle="--",
                  label="FSDP analytic bound")
    right.set_ylabel("peak memory per rank (KiB)")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.suptitle(f"{config['world_size']} ranks, {config['device']}, torch {config['torch']}, "
                    f"{config['date'][:10]}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def overhead_table(columns: list[tuple[str, dict, str, str]]) -> str:
    """A column per (title, variants, key, format of fsdp_compose's ratio to FSDP2 or "")."""
    rows = [[title, *(us(v[name][key]) if name in v else None for _, v, key, _ in columns)]
            for name, title in VARIANTS.items() if any(name in v for _, v, _, _ in columns)]
    rows.append(["ratio", *(form and format(v["fsdp_compose"][key] / v["torch fully_shard"][key],
                                            form) for _, v, key, form in columns)])
    return table(["", *(title for title, *_ in columns)], "l" + "r" * len(columns), rows)


def overhead_section(results: dict) -> list[str]:
    fake, gloo = results.get("fake"), results.get("gloo")
    c, v = (fake or gloo)["config"], (fake or gloo)["variants"]
    runs = [(r, comment, title) for r, comment, title in (
        (fake, f"fake process group, W={c['world_size']}", "Fake process group"),
        (gloo, "one gloo rank: no communication at all", "One gloo rank")) if r]
    columns = [(f"fake, W={c['world_size']}", v, "us_per_unit", ".3f"),
               ("in collectives", v, "collectives_us_per_unit", ""),
               ("runtime's own", v, "runtime_us_per_unit", ".2f")] * bool(fake) \
        + [("gloo, 1 rank", gloo and gloo["variants"], "us_per_unit", ".2f")] * bool(gloo)
    calls = [v[n]["calls_per_unit"] for n in ("fsdp_compose", "torch fully_shard")]
    said = ("Both runtimes make the same three calls per unit (an all-gather in forward and in "
            "backward, a reduce-scatter)." if calls == [3, 3] else f"fsdp_compose makes "
            f"{calls[0]:g} calls per unit into the process group, FSDP2 {calls[1]:g}.")
    if fake:
        rounds = [(a - u) / (b - u) for a, b, u in zip(*(
            v[n]["step_samples"] for n in ("fsdp_compose", "torch fully_shard", "unsharded")))]
        r, goal = v["fsdp_compose"]["us_per_unit"] / v["torch fully_shard"]["us_per_unit"], \
            GOAL_US / REFERENCE_FSDP2_US
        said += (f" Across the {len(rounds)} rounds the ratio on the fake group ranges from "
                 f"{min(rounds):.3f} to {max(rounds):.3f}. A model that ran a step under a "
                 f"`StepTrace` first costs {us(v['after a StepTrace']['us_per_unit'])} per unit "
                 f"against {us(v['fsdp_compose']['us_per_unit'])}: a closed trace leaves nothing "
                 "behind.") + (f" The goal of {GOAL_US:.0f} µs per unit, set where FSDP2 costs "
                               f"{REFERENCE_FSDP2_US:.0f} µs, is a ratio of {goal:.3f}: "
                               f"fsdp_compose's {r:.3f} is {'within' if r <= goal else 'above'} "
                               "it.") * ((c["world_size"], c["units"], c["dim"], c["batch"])
                                         == (8, 64, 64, 8))  # the goal's setting
    blocks = section(
        "CPU time per unit",
        f"{c['units']} × `Linear({c['dim']}, {c['dim']})`, batch {c['batch']}: CPU time per unit "
        "per forward + backward (step time minus the unsharded model's, per unit) in one process, "
        "and the part of it inside the process group's all-gather and reduce-scatter calls, "
        "timed in separate rounds. \"by hand\" is a unit's work and nothing else "
        "(`benchmarks/overhead.py`'s `HandShardedUnit`: the same all-gathers and copy-out, hooks, "
        "`_chunk_cat` and reduce-scatter, its gradients checked equal to fsdp_compose's), about "
        "the least a runtime of this design can cost. The fake group still copies every rank's "
        "shard into the gathered output; the one-rank gloo group communicates nothing:",
        "\n".join(command("python benchmarks/overhead.py", r["config"], comment)
                  for r, comment, _ in runs),
        " ".join(f"{title}: median of {r['config']['repeats']} rounds of {r['config']['steps']} "
                 f"steps ({provenance(r['config'])})." for r, _, title in runs),
        overhead_table(columns), said)
    more = [r for key, r in results.items() if key not in ("fake", "gloo")]
    return blocks + ([
        "A real model's units hold more parameters than a Linear's two: pre-norm transformer "
        "blocks of 12 parameters (LayerNorm, fused qkv and output projections, LayerNorm, a 4 × "
        f"MLP, all with biases; dim {more[0]['config']['dim']}, seq {more[0]['config']['seq']}), "
        "\"+ AdamW\" with a foreach AdamW step in every step, the unsharded model's too (it steps "
        f"W times the shards' elements); median of {more[0]['config']['repeats']} rounds of "
        f"{more[0]['config']['steps']} steps ({provenance(more[0]['config'])}):",
        "```bash\n" + "\n".join(command("python benchmarks/overhead.py", m["config"],
                                        f"{m['config']['backend']}, W={m['config']['world_size']}")
                                for m in more) + "\n```",
        overhead_table([(f"{m['config']['units']} × {m['config']['block']} block".replace(
            "linear block", "Linear") + " + AdamW" * m["config"]["optimizer"], m["variants"],
            "us_per_unit", ".3f") for m in more])] if more else [])


def scale_table(worlds: list[dict]) -> str:
    rows = [[str(r["world_size"]), *(kib(r["peak_memory"][n]["Total"]) for n in SHARDED),
             f"{r['peak_memory']['fsdp_compose']['Total'] / r['analytic']['memory_bound']:.2f}",
             *(f"{r['communication']['fsdp_compose']['bytes'].get(kind, 0):,} B"
               for kind in ("all_gather", "reduce_scatter")),
             "yes" if at_floor(r["communication"]["fsdp_compose"], r["analytic"])
             and r["communication"]["fsdp_compose"] == r["communication"]["FSDP2"] else "**no**",
             *(f"{r['step_seconds'][n] * 1e3:.1f}" for n in SHARDED)] for r in worlds]
    return table(["W", "peak / rank", "FSDP2", "vs bound", "all-gathered", "reduce-scattered",
                  "= floor = FSDP2", "step ms", "FSDP2"], "rrrrrrcrr", rows)


def scale_section(data: dict) -> list[str]:
    config, sizes = data["config"], [r["world_size"] for r in data["worlds"]]
    spread = max((max(abs(s / statistics.median(t) - 1) for s in t) for t in
                  data["worlds"][-1]["step_samples"].values() if len(t) > 1), default=0)
    return section(
        "Scale",
        f"The same GPT at W = {', '.join(map(str, sizes))} ranks, one rank of each simulated in "
        "one process on the fake process group: peak memory per rank of both runtimes against "
        "the analytic bound, bytes per step (a buffer each; a ring sends (W-1)/W of it per rank) "
        "against the analytic floor, and the CPU time of a step (mostly the fake group filling "
        f"its buffers; at W = {sizes[-1]} a runtime's timed steps lie within ±{spread:.0%} of "
        "their median). Every parameter is padded to W shards on dim 0: once W passes a "
        "dimension each rank keeps a padded row of it, and the shards stop shrinking. "
        "`--worlds`, `--rank` and the model's sizes are options:",
        command("python benchmarks/scale.py", config,
                f"W = {', '.join(map(str, sizes))}: {duration(config)}"),
        f"GPT of {config['depth']} blocks, dim {config['dim']}, seq {config['seq']}, batch "
        f"{config['batch']}, largest dimension {config['largest_rows']} rows; rank "
        f"{config['rank']}, median of {config['steps']} steps per size ({provenance(config)}):",
        scale_table(data["worlds"]))


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


def optimizer_section(result: dict) -> list[str]:
    return section(
        "The optimizer step",
        "AdamW's step alone, ms, over the sharded parameters of 8 blocks (dim "
        + " and ".join(dim.removeprefix("dim ") for dim in result["ms_per_step"])
        + f", 12 parameters each) on a fake group of {result['config']['world']}, per "
        "mixed-precision policy (the parameters stay float32), median of "
        f"{result['config']['rounds']} interleaved rounds. fsdp_compose's AdamW computes on the "
        "local tensors (docs/design.md, \"The optimizer step on local shards\"); FSDP2's pays "
        "DTensor's dispatch on every op; \"plain\" steps ordinary tensors holding the same local "
        "shards and gradients. What fsdp_compose adds to plain tensors, torch's loop reading "
        "DTensors and the unwrapping of the lists handed to the arithmetic, is about 0.1 ms per "
        "96 parameters, most visible beside the fused kernel:",
        "python benchmarks/optimizer.py", provenance(result["config"]), optimizer_table(result))


def full_state_dict_table(result: dict) -> str:
    rows = [[name, *(f"{row[key]:.1f} MiB" for key in ("whole_mib", "largest_tensor_mib")),
             *(f"{row[way]['peak_extra_mib']:.1f} MiB" for way in (SAVE, DCP)),
             f"**{row[SAVE]['peak_extra_mib'] / row[DCP]['peak_extra_mib']:.2f}**"]
            for name, row in result["models"].items()]
    return table(["model", "weights", "largest tensor", "streamed", "DCP full state dict",
                  "ratio"], "lrrrrr", rows)


def full_state_dict_section(result: dict) -> list[str]:
    return section(
        "Whole checkpoints",
        "Rank 0's peak resident memory above what it held before, writing a whole checkpoint "
        "(float32) of a sharded model: `save_full_state_dict` (safetensors, a tensor gathered "
        "and written at a time) against torch.distributed.checkpoint's "
        "`get_model_state_dict(full_state_dict=True, cpu_offload=True)` and safetensors' "
        "`save_file` (the whole state dict on rank 0). Streaming holds about one tensor at a "
        "time, whatever the model's size (twice the largest here: gloo's all-gather stages its "
        "output); the other way, the whole model:",
        command("torchrun --nproc_per_node=2 benchmarks/full_state_dict.py", result["config"],
                "CPU, gloo"),
        f"{result['config']['world_size']} gloo ranks ({provenance(result['config'])}):",
        full_state_dict_table(result))


def weights_table(result: dict) -> str:
    rows = [[model, way, f"{r['ms']:.1f}",
             f"{r['ms'] / ways[LOOP]['ms']:.2f}" if way.startswith("out") else "",
             f"{r['collectives']:.0f}", f"{r['peak MiB']:.2f} MiB"]
            for model, ways in result["results"].items() for way, r in ways.items()]
    return table(["model", "way", "ms", "vs the loop", "collectives", "peak"], "llrrrr", rows)


def weights_section(result: dict) -> list[str]:
    return section(
        "Weights out and in",
        "A sharded model's weights whole, as an RL trainer sends them to an inference engine: "
        "`iter_full_state_dict` (an all-gather per unit, or per piece of a unit past its largest "
        "tensor and 4 MiB) against a loop of `full_tensor()` (one per tensor) and DCP's "
        "`get_model_state_dict(full_state_dict=True, cpu_offload=True)`; back in, whole tensors "
        "streamed into `load_full_state_dict(model, pairs)` against DCP's "
        "`set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)` (all at once on "
        "rank 0). Peak: tensor memory above what was live (`MemTracker`), each tensor dropped "
        "as it arrives. With few large tensors each goes alone and the peak stays one tensor:",
        "torchrun --nproc_per_node=2 benchmarks/weights.py",
        f"{result['config']['world']} gloo ranks ({provenance(result['config'])}):",
        weights_table(result))


def render(found: dict, results: Path, figure: str | None) -> str:
    missing = [f"{name} (no `{results / name}.json`: run its command above)" for name in RESULTS
               if name not in found]
    blocks = ["# Performance",
              "<!-- Generated by benchmarks/report.py from "
              f"{', '.join(f'{results / n}.json' for n in found)}: edit benchmarks/report.py, not "
              "this file, and run the benchmarks and the report again. -->",
              "Every figure on this page is read from the benchmarks' output; after running them, "
              "`python benchmarks/report.py` writes this page and its chart again:", COMMANDS,
              *(["Not on this page yet: " + "; ".join(missing) + "."] * bool(missing))]
    sections = {"step": lambda result: step_section(result, figure), "overhead": overhead_section,
                "scale": scale_section, "optimizer": optimizer_section,
                "full_state_dict": full_state_dict_section, "weights": weights_section}
    if not any(found.get("overhead", {}).get(backend) for backend in ("fake", "gloo")):
        found.pop("overhead", None)  # other runs' columns go below the default runs'
    for name in (name for name in RESULTS if name in found):
        blocks += sections[name](found[name])
    # Prose wrapped to 92 columns; tables, code, images, headings and comments as they are.
    return "\n\n".join(block if block.startswith(("|", "```", "!", "#", "<!--")) else
                       textwrap.fill(" ".join(block.split()), 92, break_long_words=False,
                                     break_on_hyphens=False) for block in blocks) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"),
                        help="where the benchmarks wrote their JSON")
    parser.add_argument("--out", type=Path, default=Path("docs"),
                        help="where performance.md and performance.png go")
    args = parser.parse_args(argv)
    paths = {name: args.results / f"{name}.json" for name in RESULTS}
    found = {name: json.loads(path.read_text()) for name, path in paths.items() if path.exists()}
    if not found:
        parser.error(f"no results in {args.results}: run the benchmarks first")
    for name in (name for name in RESULTS if name not in found):
        print(f"missing {paths[name]}: no {name} section")
    for backend in ("fake", "gloo"):
        if backend not in found.get("overhead", {backend: 0}):
            print(f"missing the {backend} backend in {paths['overhead']}: no {backend} column "
                  f"(python benchmarks/overhead.py --backend {backend})")
    args.out.mkdir(parents=True, exist_ok=True)
    png, page = args.out / "performance.png", args.out / "performance.md"
    figure = png.name if "step" in found and plot_step(found["step"], png) else None
    if "step" in found and not figure:
        print(f"matplotlib not installed: {page} without its chart (pip install matplotlib)"
              + (f"; {png} left as it was, unlinked" if png.exists() else ""))
    page.write_text(render(found, args.results, figure))
    print(f"wrote {page}" + (f" and {png}" if figure else ""))


if __name__ == "__main__":
    main()
