"""python -m fsdp_compose.run: run a program with fsdp_compose in place of torch's fully_shard.

    python -m fsdp_compose.run train.py --lr 1e-3
    torchrun --nproc_per_node=8 -m fsdp_compose.run -m torchtitan.train --job.config_file x.toml

It calls replace_torch_fsdp before the program imports anything, then runs the script or
module as `__main__` as Python would (its argv, its folder on sys.path, its exit code and
exceptions). Rank 0 (the RANK variable launchers set) says which implementation is in place.
Every Python process the program starts switches too (fsdp_compose/startup/sitecustomize.py)."""

from __future__ import annotations

import os
import runpy
import sys

from .api.torch_switch import replace_torch_fsdp

# Where startup/sitecustomize.py lies, and the variable it reads: how children switch.
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
SWITCH_ENV = "FSDP_COMPOSE_SWITCH"
USAGE = "usage: python -m fsdp_compose.run (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return
    if not args or args == ["-m"]:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    switch = replace_torch_fsdp()
    os.environ[SWITCH_ENV] = "1"  # for children: spawned, or any Python subprocess
    paths = [STARTUP, os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    if os.environ.get("RANK", "0") == "0":
        print(f"fsdp_compose.run: torch.distributed.fsdp.fully_shard is fsdp_compose's "
              f"({len(switch.names)} names rebound)", file=sys.stderr, flush=True)
    if args[0] == "-m":
        sys.argv = args[1:]  # run_module puts the module's file in argv[0]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args[:]
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as `python script.py`
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
