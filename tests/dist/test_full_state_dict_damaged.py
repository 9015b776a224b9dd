"""save_full_state_dict / load_full_state_dict when the files fail them: a damaged or missing
checkpoint, a path that cannot be written, a full disk. Only the first rank touches the
files, yet every rank raises the same error (class and message, naming the file and the
fault), nothing is loaded, no `*.incomplete` file is left, and a checkpoint that was
already at the path stays byte for byte as it was."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import fsdp_compose.io.full_state_dict as full_state_dict
import fsdp_compose.io.safetensors_writer as safetensors_writer
from fsdp_compose import fully_shard, load_full_state_dict, save_full_state_dict
from tests.dist.parity import full, make_mesh, per_block
from tests.models import Transformer
from tests.safetensors_damage import damaged_files, damaged_indexes, missing_paths

SEVERAL_FILES = 4096  # max_shard_size: the tiny Transformer takes several files

Outcome = tuple[str, str]  # the class name and message a call raised


def model_of(seed: int, shard: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = Transformer(tie_weights=True)
    if shard:
        per_block(model, fully_shard, mesh=make_mesh())
    return model


def raised(fn, *args, **kwargs) -> Outcome:
    try:
        fn(*args, **kwargs)
    except Exception as error:
        return type(error).__name__, str(error)
    return "no error", ""


@contextlib.contextmanager
def first_rank_fault(fault: str | None, path: str) -> Iterator[None]:
    """The fault on the first rank (the only one that touches files); the others unpatched."""
    with pytest.MonkeyPatch.context() as patch:
        if dist.get_rank() == 0 and fault == "read error":
            failing_read = failing_after(2, full_state_dict._read, errno.EIO)
            patch.setattr(full_state_dict, "_read", failing_read)
        if dist.get_rank() == 0 and fault == "read-only" and os.access(path, os.W_OK):
            # As root, chmod does not stop writes: open() refuses as it would for a user.
            patch.setattr(safetensors_writer, "open", refusing_in(path), raising=False)
        if dist.get_rank() == 0 and fault is not None and fault.startswith("disk full in "):
            write = safetensors_writer._Writer.write
            stop = fault.removeprefix("disk full in ")
            patch.setattr(safetensors_writer._Writer, "write", full_disk_in(stop, write))
        yield


def failing_after(calls: int, fn, code: int):
    count = [0]

    def failing(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise OSError(code, os.strerror(code))
        return fn(*args, **kwargs)
    return failing


def refusing_in(folder: str):
    def refusing(file, mode="r", *args, **kwargs):
        if str(file).startswith(folder) and "w" in mode:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return open(file, mode, *args, **kwargs)
    return refusing


def full_disk_in(prefix: str, write):
    """The writer's write, failing as a full disk does at the second tensor of the file
    whose name starts with `prefix` (the first reaches the disk)."""
    def failing(self, tensor):
        if self.path.name.startswith(prefix):
            self.writes = getattr(self, "writes", 0) + 1
            if self.writes == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(self, tensor)
    return failing


def check_loads_refused(
    cases: list[tuple[str, str, str | None]], good: str
) -> tuple[dict[str, Outcome], bool, bool]:
    """Each case's outcome, by name; whether the model kept its values throughout; whether
    the good checkpoint loads afterwards (the ranks are still in step)."""
    model = model_of(seed=1, shard=True)
    before = {k: full(v).clone() for k, v in model.state_dict().items()}
    outcomes = {}
    for name, path, fault in cases:
        with first_rank_fault(fault, path):
            outcomes[name] = raised(load_full_state_dict, model, path)
    kept = all(torch.equal(full(v), before[k]) for k, v in model.state_dict().items())
    load_full_state_dict(model, good)
    reference = model_of(seed=0, shard=False).state_dict()
    loaded = all(torch.equal(full(v), reference[k]) for k, v in model.state_dict().items())
    return outcomes, kept, loaded


def test_damaged_checkpoints_refused_on_every_rank(ranks, tmp_path):
    model = model_of(seed=0, shard=False)  # no process group here: this process writes
    good = tmp_path / "good.safetensors"
    save_full_state_dict(model, good)
    save_full_state_dict(model, tmp_path / "sharded", max_shard_size=SEVERAL_FILES)
    damages = [
        *damaged_files(good, tmp_path),
        *damaged_indexes(tmp_path / "sharded", tmp_path),
        *missing_paths(tmp_path),
    ]
    cases = [(d.name, str(d.path), None) for d in damages]
    # A read that fails after the header was checked (a disk error) is shared the same way.
    cases.append(("read error", str(good), "read error"))
    read_error = f"[Errno 5] load_full_state_dict: cannot read {good}: Input/output error."
    expected = {d.name: d.error for d in damages} | {"read error": ("OSError", read_error)}
    results = ranks.run(check_loads_refused, cases=cases, good=str(good))
    assert results[0] == results[1]
    outcomes, kept, loaded = results[0]
    assert kept and loaded  # refused before any tensor was loaded; then loads the good one
    for name, error in expected.items():
        assert outcomes[name] == error, name


def check_saves_refused(
    cases: list[tuple[str, str, int, str | None]], after: str
) -> dict[str, Outcome]:
    """Each case's outcome, by name; then a save to `after` (the ranks are still in step)."""
    model = model_of(seed=1, shard=True)  # other values than the checkpoints already there
    outcomes = {}
    for name, path, max_shard_size, fault in cases:
        with first_rank_fault(fault, path):
            outcomes[name] = raised(
                save_full_state_dict, model, path, max_shard_size=max_shard_size
            )
    save_full_state_dict(model, after)
    return outcomes


def test_failed_saves_raise_on_every_rank_and_keep_the_previous_checkpoint(ranks, tmp_path):
    previous = model_of(seed=0, shard=False).state_dict()
    folders = (("read-only", 2**30), ("full", 2**30), ("full-sharded", SEVERAL_FILES))
    for folder, max_shard_size in folders:
        save_full_state_dict(
            model_of(seed=0, shard=False), tmp_path / folder, max_shard_size=max_shard_size
        )
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "a-directory.safetensors").mkdir()
    saved = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    second = sorted(p.name for p in (tmp_path / "full-sharded").glob("model-00002-*"))[0]
    cases = [
        ("parent is a file", str(tmp_path / "a-file" / "model.safetensors"), 2**30, None),
        ("ancestor is a file", str(tmp_path / "a-file" / "sub"), 2**30, None),
        ("target is a directory", str(tmp_path / "a-directory.safetensors"), 2**30, None),
        ("read-only directory", str(tmp_path / "read-only"), 2**30, "read-only"),
        ("disk full", str(tmp_path / "full"), 2**30, "disk full in model.safetensors"),
        ("disk full in the second file", str(tmp_path / "full-sharded"), SEVERAL_FILES,
         "disk full in model-00002"),
    ]
    cannot = "save_full_state_dict: cannot write"
    a_file = tmp_path / "a-file"
    expected = {
        "parent is a file": ("NotADirectoryError",
            f"[Errno 20] {cannot} {a_file / 'model.safetensors'}: {a_file} is a file, not "
            "a directory."),
        "ancestor is a file": ("NotADirectoryError",
            f"[Errno 20] {cannot} {a_file / 'sub' / 'model.safetensors'}: {a_file} is a file, not "
            "a directory."),
        "target is a directory": ("IsADirectoryError",
            f"[Errno 21] {cannot} {tmp_path / 'a-directory.safetensors'}: it is a directory. "
            "Remove it, or pass a path without .safetensors to save into it."),
        "read-only directory": ("PermissionError",
            f"[Errno 13] {cannot} {tmp_path / 'read-only' / 'model.safetensors'}: "
            "Permission denied."),
        "disk full": ("OSError",
            f"[Errno 28] {cannot} {tmp_path / 'full' / 'model.safetensors'}: "
            "No space left on device."),
        "disk full in the second file": ("OSError",
            f"[Errno 28] {cannot} {tmp_path / 'full-sharded' / second}: No space left on device."),
    }
    (tmp_path / "read-only").chmod(0o555)
    try:
        results = ranks.run(check_saves_refused, cases=cases, after=str(tmp_path / "after"))
    finally:
        (tmp_path / "read-only").chmod(0o755)
    assert results[0] == results[1] == expected
    assert sorted(p.name for p in tmp_path.rglob("*.incomplete")) == []
    after = tmp_path / "after" / "model.safetensors"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != after} == saved
    for file, state in ((tmp_path / "read-only" / "model.safetensors", previous),
                        (tmp_path / "full" / "model.safetensors", previous),
                        (after, model_of(seed=1, shard=False).state_dict())):
        loaded = load_file(file)
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), file
