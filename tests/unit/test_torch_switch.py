"""replace_torch_fsdp(): torch's public FSDP2 names are fsdp_compose's while it is on, torch's
again after restore(); FSDP1 untouched; refused once torch's fully_shard annotated a module;
a warning names the modules that bound torch's names first. And the launcher, python -m
fsdp_compose.run, runs a script or module as Python would."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch.distributed.fsdp as torch_fsdp

import fsdp_compose
from fsdp_compose import replace_torch_fsdp
from fsdp_compose.api.torch_switch import OURS, TORCH_MODULES

ROOT = Path(__file__).resolve().parents[2]


def torch_names() -> dict[tuple[str, str], object]:
    """What each of torch's modules binds now, for the names the switch replaces."""
    found = {}
    for module_name in TORCH_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in OURS:
            if hasattr(module, name):
                found[(module_name, name)] = getattr(module, name)
    return found


def test_switch_rebinds_every_name_and_restore_puts_torchs_back():
    before = torch_names()
    assert ("torch.distributed.fsdp", "fully_shard") in before
    fsdp1 = torch_fsdp.FullyShardedDataParallel
    switch = replace_torch_fsdp()
    try:
        during = torch_names()
        assert set(during) == set(before)
        for (module, name), value in during.items():
            assert value is OURS[name], (module, name)
            assert value is getattr(fsdp_compose, name), name
        assert sorted(switch.names) == sorted(f"{m}.{n}" for m, n in before)
        assert torch_fsdp.FullyShardedDataParallel is fsdp1  # FSDP1 stays torch's
        assert replace_torch_fsdp().names == []  # on again: nothing more to do or undo
    finally:
        switch.restore()
    assert torch_names() == before
    switch.restore()  # a second restore does nothing
    assert torch_names() == before


def test_switch_is_a_context_manager():
    before = torch_names()
    with replace_torch_fsdp():
        assert torch_fsdp.fully_shard is fsdp_compose.fully_shard
    assert torch_names() == before


def test_switch_warns_about_modules_that_bound_torchs_names_first():
    early = types.ModuleType("a_framework.parallelize")
    early.fully_shard = torch_fsdp.fully_shard
    early.shard_fn = torch_fsdp.fully_shard  # from torch.distributed.fsdp import ... as shard_fn
    sys.modules[early.__name__] = early
    try:
        # (other test modules of this process may be named after these)
        with pytest.warns(RuntimeWarning, match=r"\['a_framework.parallelize.fully_shard', "
                          r"'a_framework.parallelize.shard_fn'(, '[\w.]+')*\] were bound to "
                          r"torch's FSDP2 objects before the switch .* python -m fsdp_compose.run"):
            switch = replace_torch_fsdp()
        switch.restore()
        assert early.fully_shard is torch_fsdp.fully_shard  # it keeps torch's
    finally:
        del sys.modules[early.__name__]


REFUSAL = """
import os, tempfile
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from fsdp_compose import replace_torch_fsdp
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = fully_shard(torch.nn.Linear(4, 4))
try:
    replace_torch_fsdp()
except RuntimeError as error:
    print(error)
dist.destroy_process_group()
"""


def test_switch_is_refused_once_torchs_fully_shard_annotated_a_module():
    done = subprocess.run([sys.executable, "-c", REFUSAL], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replace_torch_fsdp: torch's fully_shard already annotated ['FSDPLinear']" in done.stdout


PROGRAM = """
import sys
import torch.distributed.fsdp as fsdp
print("argv", sys.argv[1:], "path0", sys.path[0], "ours", fsdp.fully_shard.__module__)
if sys.argv[1:] == ["exit"]:
    raise SystemExit(3)
if sys.argv[1:] == ["raise"]:
    raise ValueError("raised by the program")
"""


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsdp_compose.run", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_launcher_runs_a_script_or_module_as_python_would(tmp_path):
    folder = tmp_path / "program"
    folder.mkdir()
    (folder / "prog.py").write_text(PROGRAM)
    ran = launch(str(folder / "prog.py"), "a", "--b", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert f"argv ['a', '--b'] path0 {folder} ours fsdp_compose.api.fully_shard" in ran.stdout
    said = "fsdp_compose.run: torch.distributed.fsdp.fully_shard is fsdp_compose's"
    assert ran.stderr.count(said) == 1
    as_module = launch("-m", "prog", "x", cwd=folder)
    assert "argv ['x']" in as_module.stdout and "ours fsdp_compose" in as_module.stdout
    assert launch(str(folder / "prog.py"), "exit", cwd=tmp_path).returncode == 3
    raised = launch(str(folder / "prog.py"), "raise", cwd=tmp_path)
    assert raised.returncode == 1 and "ValueError: raised by the program" in raised.stderr
    assert launch(cwd=tmp_path).returncode == 2 and launch("--help", cwd=tmp_path).returncode == 0


def test_launcher_prints_its_line_on_rank_0_only(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    env_rank_1 = subprocess.run(
        [sys.executable, "-m", "fsdp_compose.run", "prog.py"], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, env={**__import__("os").environ, "RANK": "1"},
    )
    assert env_rank_1.returncode == 0 and "fsdp_compose.run:" not in env_rank_1.stderr


def test_the_runtime_never_imports_torchs_fsdp():
    """No module of the package imports torch's FSDP; only the switch names its modules,
    as strings it imports by when called (docs/design.md, section 7)."""
    import ast

    naming = []
    for file in sorted((ROOT / "fsdp_compose").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
            ):
                naming.append(f"{file.name}: from {node.module} import")
            if isinstance(node, ast.Import) and any(
                a.name.startswith("torch.distributed.fsdp") for a in node.names
            ):
                naming.append(f"{file.name}: import")
            if isinstance(node, ast.Constant) and node.value in TORCH_MODULES:
                naming.append(f"{file.name}: {node.value!r}")
    # The children's switch waits for the module's import by name (it imports nothing).
    naming.remove("sitecustomize.py: 'torch.distributed.fsdp'")
    assert all(entry.startswith("torch_switch.py: '") for entry in naming), naming
    assert len(naming) == len(TORCH_MODULES)


SPAWNING = """
import multiprocessing, subprocess, sys
import torch.multiprocessing as mp


def child(i):
    from torch.distributed.fsdp import FSDPModule, fully_shard as shard_fn
    print("child", i, shard_fn.__module__, FSDPModule.__module__, flush=True)


if __name__ == "__main__":
    mp.spawn(child, nprocs=1)
    process = multiprocessing.get_context("spawn").Process(target=child, args=(1,))
    process.start()
    process.join()
    subprocess.run([sys.executable, "-c", "from torch.distributed.fsdp import fully_shard; "
                    "import sitecustomize; print('subprocess', fully_shard.__module__, "
                    "sitecustomize.__file__)"], check=True)
"""


def test_the_launchers_switch_reaches_every_process_it_starts(tmp_path):
    """Children of torch.multiprocessing.spawn, multiprocessing's spawn and a subprocess run
    fsdp_compose's fully_shard; a sitecustomize of the user's own still runs."""
    (tmp_path / "prog.py").write_text(SPAWNING)
    (tmp_path / "site").mkdir()
    users_own = tmp_path / "site" / "sitecustomize.py"
    users_own.write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-m", "fsdp_compose.run", str(tmp_path / "prog.py")],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    ours = "fsdp_compose.api.fully_shard fsdp_compose.api.fsdp_module"
    assert f"child 0 {ours}" in out and f"child 1 {ours}" in out, out
    assert f"subprocess fsdp_compose.api.fully_shard {users_own}" in out


def test_every_public_fsdp2_name_torch_exports_is_switched():
    public = set(importlib.import_module("torch.distributed.fsdp._fully_shard").__all__)
    with replace_torch_fsdp():
        switched = {
            name for name in public if getattr(torch_fsdp, name) is getattr(fsdp_compose, name)}
        state = torch_fsdp.fully_shard.state
    assert public and switched == public, public - switched
    assert state is fsdp_compose.fully_shard.state  # torch's contract: the module's state
