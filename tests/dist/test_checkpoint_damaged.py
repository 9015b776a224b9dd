"""A damaged sharded checkpoint (load_checkpoint over torch.distributed.checkpoint): refused
with one error naming the file and the fault, the same on every rank, and the model and
optimizer exactly as they were, whether a check caught the damage before any tensor moved
or the read itself failed."""

from __future__ import annotations

import gc
import json
import os
import pickle
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_compose import load_checkpoint, save_checkpoint
from fsdp_compose.io.checkpoint_files import CHECKSUMS
from tests.dist.training import new_run, train, whole_state

SHARD = "__1_0.distcp"  # rank 1's file


def items_of(path: Path, name: str) -> list[tuple[int, int]]:
    """(offset, length) of every item the metadata places in file `name`."""
    with open(path / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    return sorted((i.offset, i.length) for i in metadata.storage_data.values()
                  if i.relative_path == name)


def cut(file: Path, size: int) -> None:
    with open(file, "r+b") as stream:
        stream.truncate(size)


def flip(file: Path, at: int, count: int = 16) -> None:
    with open(file, "r+b") as stream:
        stream.seek(at)
        data = stream.read(count)
        stream.seek(at)
        stream.write(bytes(b ^ 0xFF for b in data))


def damage(path: Path, how: str) -> None:
    shard = path / SHARD
    items = items_of(path, SHARD)
    if how == "metadata cut":
        cut(path / ".metadata", (path / ".metadata").stat().st_size // 2)
    elif how == "shard cut":
        cut(shard, shard.stat().st_size // 2)
    elif how == "shard cut at a tensor boundary":
        offset, length = items[len(items) // 2]
        cut(shard, offset + length)
    elif how == "shard missing":
        shard.unlink()
    elif how == "bytes flipped":
        flip(shard, shard.stat().st_size // 2)
    elif how == "bytes flipped, no checksums":  # past every check: the read itself fails
        (path / CHECKSUMS).unlink()
        flip(shard, items[len(items) // 2][0])
    elif how == "resume file flipped":
        flip(path / "resume.rank1.pt", 40)
    elif how == "resume file missing":
        (path / "resume.rank1.pt").unlink()
    elif how == "checksums not a table":
        (path / CHECKSUMS).write_text("[1, 2]")
    elif how == "checksums without a size":
        (path / CHECKSUMS).write_text(json.dumps({SHARD: {"crc32": 1}}))
    else:
        raise ValueError(how)


EXPECTED = {  # the error each damage raises: its type and what its message must name
    "metadata cut": (ValueError, r"\.metadata' is damaged or truncated"),
    "shard cut": (ValueError, rf"{SHARD}' is truncated: \d+ bytes"),
    "shard cut at a tensor boundary": (ValueError, rf"{SHARD}' is truncated"),
    "shard missing": (FileNotFoundError, rf"{SHARD}' is missing"),
    "bytes flipped": (ValueError, rf"{SHARD}' is damaged: its size or CRC-32 differs"),
    "resume file flipped": (
        ValueError, r"resume\.rank1\.pt' is damaged: its size or CRC-32 differs"
    ),
    "resume file missing": (FileNotFoundError, r"resume\.rank1\.pt' is missing"),
    "checksums not a table": (ValueError, rf"{CHECKSUMS}' is damaged"),
    "checksums without a size": (ValueError, rf"{CHECKSUMS}' is damaged"),
    "bytes flipped, no checksums": (
        ValueError,
        r"reading .* failed \(rank [0-9, ]+: \w+: [^\n]*\); "
        r"the model and optimizer are unchanged",
    ),
}


def check_damaged_checkpoint(path: str, how: str) -> str:
    folder = Path(path)
    model, optim = new_run(seed=0)
    train(model, optim, range(2))
    save_checkpoint(folder, model, optim, step=2)
    if dist.get_rank() == 0:
        damage(folder, how)
    dist.barrier()
    model, optim = new_run(seed=1)  # other values, and optimizer state to overwrite
    train(model, optim, range(1))
    before = whole_state(model, optim)
    error_type, pattern = EXPECTED[how]
    with pytest.raises(error_type, match=pattern) as raised:
        load_checkpoint(folder, model, optim)
    after = whole_state(model, optim)
    assert list(after) == list(before)
    changed = [key for key, value in after.items() if not torch.equal(value, before[key])]
    assert changed == [], f"{how}: changed {changed}"
    return f"{type(raised.value).__name__}: {raised.value}"


@pytest.mark.parametrize("how", sorted(EXPECTED))
def test_a_damaged_checkpoint_changes_nothing_and_names_the_file(ranks, tmp_path, how):
    messages = ranks.run(check_damaged_checkpoint, path=str(tmp_path / "ckpt"), how=how)
    assert len(set(messages)) == 1, messages  # every rank raises the same error


def load_peak(path: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Tracked memory while loading, above what was live before."""
    gc.collect()
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        live = tracker.get_tracker_snapshot("current")
        load_checkpoint(path, model, optim)
    peak = tracker.get_tracker_snapshot("peak")
    device = next(iter(peak))
    return peak[device]["Total"] - live[device]["Total"]


def check_load_peak(path: str) -> tuple[int, int, int]:
    """What reading into copies costs: the load's peak, less that of the same load read
    straight into the model; and the bytes of this rank's shards and optimizer state."""
    from fsdp_compose.io import checkpoint

    model, optim = new_run(seed=0)
    train(model, optim, range(1))
    save_checkpoint(path, model, optim, step=1)
    shards = sum(p.to_local().nbytes for p in model.parameters())
    state = sum(v.to_local().nbytes for s in optim.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    load_checkpoint(path, model, optim)  # what a first load sets up once is not counted
    # The least of three loads each: how much of DCP's reading overlaps varies by run.
    with mock.patch.object(checkpoint, "_copies", lambda tree: tree):
        in_place = min(load_peak(path, model, optim) for _ in range(3))
    return min(load_peak(path, model, optim) for _ in range(3)) - in_place, shards, state


def test_loading_costs_at_most_one_copy_of_the_shards_and_state(ranks, tmp_path):
    """The peak rises by at most one copy of every tensor loaded (AdamW's scalar steps
    included: a few bytes): by about that where the load's peak is its reading, by less
    where it peaks before (the copies then overlap tensors already freed)."""
    results = ranks.run(check_load_peak, path=str(tmp_path / "ckpt"))
    for extra, shards, state in results:
        assert 0 <= extra <= shards + state + 1024, (extra, shards, state)
    assert any(extra >= (shards + state) / 2 for extra, shards, state in results), results


def test_checksums_are_written_beside_the_data(ranks, tmp_path):
    path = tmp_path / "ckpt"
    ranks.run(check_load_peak, path=str(path))
    files = sorted(f.name for f in path.iterdir() if f.suffix in (".distcp", ".pt"))  # DCP's, ours
    assert "resume.rank1.pt" in files  # each rank's optimizer param groups (resume_state.py)
    assert sorted(json.loads((path / CHECKSUMS).read_text())) == files
    assert os.path.getsize(path / CHECKSUMS) > 0


def check_a_failed_load_leaves_a_fresh_optimizer_fresh(path: str) -> tuple[str, int]:
    """"Resume, else start fresh": a load that fails in the read leaves no optimizer state."""
    model, optim = new_run(seed=0)
    train(model, optim, range(2))
    save_checkpoint(path, model, optim, step=2)
    if dist.get_rank() == 0:
        damage(Path(path), "bytes flipped, no checksums")
    dist.barrier()
    model, optim = new_run(seed=1)
    with pytest.raises(ValueError, match="reading .* failed") as raised:
        load_checkpoint(path, model, optim)
    return str(raised.value), len(optim.state)


def test_a_failed_load_leaves_a_fresh_optimizer_fresh(ranks, tmp_path):
    check = check_a_failed_load_leaves_a_fresh_optimizer_fresh
    results = ranks.run(check, path=str(tmp_path / "c"))
    assert len({message for message, _ in results}) == 1 and [n for _, n in results] == [0, 0]
