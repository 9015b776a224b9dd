"""What the sections of docs/performance.md share: how figures, tables and a run's provenance
are written, and the analytic floor of communication."""

from __future__ import annotations

from datetime import datetime


def kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def us(x: float) -> str:
    return f"{x:,.0f} µs"


def table(header: list[str], align: str, rows: list[list[str]]) -> str:
    """A markdown table; `align` has one character per column: l(eft), r(ight), c(entre)."""
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(config: dict) -> str:
    """When, with what, on what: from the config a benchmark recorded."""
    if "date" not in config:
        return "machine, versions and date not recorded"
    date = datetime.fromisoformat(config["date"]).strftime("%Y-%m-%d %H:%M UTC")
    machine = config.get("machine", {})
    where = f"{machine.get('cpu', '?')} ({machine.get('cpus', '?')} cores)"
    if machine.get("gpu"):
        where = f"{machine['gpu']}, {where}"
    return (f"{date}, torch {config.get('torch', '?')}, Python {config.get('python', '?')}, "
            f"{where}, {machine.get('platform', '?')}")


def command(prefix: str, config: dict, comment: str) -> str:
    args = " ".join(config.get("argv", []))
    line = f"{prefix} {args}".rstrip()
    return f"{line:<48} # {comment}" if comment else line


def duration(config: dict) -> str:
    seconds = config.get("wall_seconds")
    if seconds is None:
        return ""
    return f"{seconds:.0f} s" if seconds < 100 else f"about {seconds / 60:.0f} minutes"


def joined(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def at_floor(comm: dict, floor: dict) -> bool:
    """Whether a runtime's collectives (calls and bytes) are the analytic floor's."""
    return comm["calls"] == {"all_gather": floor["all_gather_calls"],
                             "reduce_scatter": floor["reduce_scatter_calls"]} and \
        comm["bytes"] == {"all_gather": floor["all_gather_bytes"],
                          "reduce_scatter": floor["reduce_scatter_bytes"]}
