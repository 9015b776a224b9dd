"""The CPU-time-per-unit section of docs/performance.md (benchmarks/overhead.py's results)."""

from __future__ import annotations

from report_format import command, provenance, table, us

BY_HAND = "by hand"  # benchmarks/handwritten.py's variant in overhead.json
# The machine the CPU-overhead goal was set on: FSDP2's cost per unit there, and the goal.
# They are not this run's figures (this run's FSDP2 figure is set against them).
REFERENCE_FSDP2_US = 580.0
GOAL_US = 100.0

OVERHEAD = """\
## CPU time per unit

CPU time per unit per forward + backward, in one process with the fake process group
(W={world}, {units} × `Linear({dim}, {dim})`, batch {batch}: step time minus the unsharded
model's, divided by {units}), and the part of it spent inside the process group's all-gather
and reduce-scatter calls, timed in separate rounds; the rest is the runtime's own:

```bash
{commands}
```

{provenance}

{table}

{spread}{goal}{traced}{by_hand}

{calls} The fake group still copies every rank's shard into the gathered output{copies}{gloo}
Next come a skeleton of the same hooks (pre/post-forward, a pre-hook on the output's node,
a hook on each parameter's gradient accumulation) and the unit's tensor work: copying the
gathered rows out, chunking the gradients in, and allocating and freeing buffers. A unit's
shards live in one flat tensor, which its one all-gather sends as is; the all-gather's
output and the reduce-scatter's input are reused tensors, shaped once, whose storage is
resized per use; the parameters share one unsharded storage, into which one
`split_with_sizes_copy` copies the gathered rows; a unit whose parameters all train
learns that its backward is done from hooks on their gradient accumulation, registered once,
rather than from a view of each input with a node hook made at every forward (which costs
more, and which units with frozen parameters still pay); a unit swaps the registrations of
all its parameters with one dict update per owning module, and checks them for replaced or
frozen parameters once per iteration rather than per gather; a module carries two hooks (one
post-forward hook, called also when forward raised, undoes a failed forward), called without
a wrapper; the collectives are issued with options, group sizes and dtypes decided once, not
asked of the group or the tensors per call (in this setting every touch of a cold Python
object or tensor costs tenths of a microsecond); and reduced gradient shards are added with
one op to `.grad`s that are still views of an earlier reduction. The rest is bookkeeping in
Python.
{blocks}"""


def overhead_section(results: dict) -> str:
    fake, gloo = results.get("fake"), results.get("gloo")
    first = fake or gloo
    config = first["config"]
    header, align = [""], "l"
    labels = {"fsdp_compose": "fsdp_compose", "torch fully_shard": "torch's fully_shard"}
    if all(BY_HAND in r["variants"] for r in (fake, gloo) if r):
        labels[BY_HAND] = BY_HAND
    names = list(labels)
    rows = [[labels[name]] for name in names] + [["ratio"]]
    if fake:
        v = fake["variants"]
        header += [f"fake, W={fake['config']['world_size']}", "in collectives", "runtime's own"]
        align += "rrr"
        for row, name in zip(rows, names):
            row += [us(v[name]["us_per_unit"]), us(v[name]["collectives_us_per_unit"]),
                    us(v[name]["runtime_us_per_unit"])]
        rows[-1] += [f"{ratio(v, 'us_per_unit'):.3f}", "", f"{ratio(v, 'runtime_us_per_unit'):.2f}"]
    if gloo:
        v = gloo["variants"]
        header.append("gloo, 1 rank")
        align += "r"
        for row, name in zip(rows, names):
            row.append(us(v[name]["us_per_unit"]))
        rows[-1].append(f"{ratio(v, 'us_per_unit'):.2f}")
    commands, lines = [], []
    for backend, result, comment in (("fake", fake, f"fake process group, W={config['world_size']}"),
                                     ("gloo", gloo, "one gloo rank: no communication at all")):
        if result:
            c = result["config"]
            commands.append(command("python benchmarks/overhead.py", c, comment))
            lines.append(f"{'Fake process group' if backend == 'fake' else 'One gloo rank'}: "
                         f"median of {c['repeats']} rounds of {c['steps']} steps ({provenance(c)}).")
    return OVERHEAD.format(
        world=config["world_size"] if fake else 8, units=config["units"], dim=config["dim"],
        batch=config["batch"], commands="\n".join(commands), provenance="\n".join(lines),
        table=table(header, align, rows), spread=overhead_spread(fake),
        goal=overhead_goal(fake), calls=overhead_calls(first),
        copies=" (a copy per rank)" if fake else "",
        gloo=overhead_gloo(fake, gloo), traced=overhead_traced(fake),
        by_hand=overhead_by_hand(fake), blocks=overhead_blocks(results),
    )


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
            f"{REFERENCE_FSDP2_US:.0f} µs it costs on the machine where the goal of {GOAL_US:.0f} µs "
            f"per unit was set, so that goal is a ratio of about {goal:.3f}; fsdp_compose's "
            f"{r:.3f} is about {r * REFERENCE_FSDP2_US:.0f} µs there, "
            f"{'within' if r <= goal else 'above'} the goal.")


def overhead_by_hand(fake: dict | None) -> str:
    """The design's floor: the same work done by hand, against both runtimes."""
    if not fake or BY_HAND not in fake["variants"]:
        return ""
    v = fake["variants"]
    hand, ours = v[BY_HAND]["us_per_unit"], v["fsdp_compose"]["us_per_unit"]
    theirs = v["torch fully_shard"]["us_per_unit"]
    return (f"\n\nThe row \"by hand\" is a unit's work written out with nothing else "
            f"(`benchmarks/handwritten.py`: the same all-gathers and copy-out, hooks, "
            f"`_chunk_cat` and reduce-scatter; its gradients are checked equal to fsdp_compose's before the "
            f"timing). It costs {us(hand)} per unit, {hand / theirs:.3f} of FSDP2's: what the work "
            f"of this design costs on this machine with no runtime around it, about the least a "
            f"runtime built on these hooks and collectives can cost. " + (
                f"fsdp_compose's checks, state and features add {us(ours - hand)} "
                f"({(ours - hand) / hand:.0%}) over it." if ours > hand else
                "fsdp_compose measured no more than it in this run."))


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
                f"the collectives altogether (the one-rank gloo column) saves about {us(saved)} of "
                f"fsdp_compose's figure, more than the {us(inside)} spent inside them.")
    return (f": removing the collectives altogether (the one-rank gloo column) saves about "
            f"{us(saved)} of fsdp_compose's figure, against {us(inside)} timed inside them.")


def overhead_blocks(results: dict) -> str:
    """The runs with other units or an optimizer step (overhead.py --block, --optimizer),
    kept in overhead.json beside the default's: one column each."""
    runs = [r for key, r in results.items() if key not in ("fake", "gloo")]
    if not runs:
        return ""
    header, rows = [""], [[name] for name in ("fsdp_compose", "torch's fully_shard", BY_HAND, "ratio")]
    commands = []
    for run in runs:
        c, v = run["config"], run["variants"]
        unit = "Linear" if c.get("block", "linear") == "linear" else "transformer block"
        header.append(f"{c['units']} × {unit}{' + AdamW' if c.get('optimizer') else ''}")
        for row, name in zip(rows, ("fsdp_compose", "torch fully_shard", BY_HAND)):
            row.append(us(v[name]["us_per_unit"]) if name in v else "–")
        rows[-1].append(f"{ratio(v, 'us_per_unit'):.3f}")
        commands.append(command("python benchmarks/overhead.py", c, f"{c['backend']}, W={c['world_size']}"))
    first = runs[0]["config"]
    blocks = (f" on pre-norm transformer blocks of 12 parameters (LayerNorm, fused qkv and output "
              f"projections, LayerNorm, a 4 × MLP, all with biases; dim {first['dim']}, seq "
              f"{first.get('seq', '?')})" if any(r["config"].get("block") == "transformer" for r in runs)
              else "")
    adamw = (", with \"+ AdamW\" a foreach AdamW step in every contender's step, the unsharded "
             "model's included (which steps W times the elements the shards do)"
             if any(r["config"].get("optimizer") for r in runs) else "")
    return (f"\nA real model's units hold more parameters than a Linear's two. The same measure "
            f"(median of {first['repeats']} rounds of {first['steps']} steps, {provenance(first)})"
            f"{blocks}{adamw}:\n\n```bash\n" + "\n".join(commands) + "\n```\n\n"
            + table(header, "l" + "r" * len(runs), rows) + "\n")
