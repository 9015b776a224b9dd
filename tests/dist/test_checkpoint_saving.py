"""save_checkpoint fails alike: an error on the first rank (which alone renames and writes
the checksums) is raised on every rank at once, none waiting for the group's timeout; and at
every moment of a save a complete checkpoint is where load_checkpoint finds it."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import load_checkpoint, save_checkpoint
from fsdp_compose.io import checkpoint
from fsdp_compose.io.checkpoint_files import checksums
from tests.dist.training import new_run, train, whole_state


def check_a_first_rank_failure_raises_everywhere(path: str, fails: str) -> tuple[str, float, bool]:
    model, optim = new_run(seed=0)
    train(model, optim, range(1))
    save_checkpoint(path, model, optim, step=1)
    saved = whole_state(model, optim)
    train(model, optim, range(1, 2))
    # On the first rank, `fails` (Path.rename or Path.write_text) fails once DCP wrote the data.
    failing = mock.patch.object(Path, fails, side_effect=OSError(39, "Directory not empty"))

    def data_written(folder: Path) -> str:
        sums = checksums(folder)
        if dist.get_rank() == 0:
            failing.start()
        return sums

    start = time.monotonic()
    with mock.patch.object(checkpoint, "checksums", data_written), pytest.raises(
            OSError, match="save_checkpoint: could not put the checkpoint in place") as raised:
        try:
            save_checkpoint(path, model, optim, step=2)
        finally:
            if dist.get_rank() == 0:
                failing.stop()
    took = time.monotonic() - start
    model, optim = new_run(seed=1)
    step = load_checkpoint(path, model, optim)  # the previous checkpoint, whole
    after = whole_state(model, optim)
    same = step == 1 and all(torch.equal(after[k], v) for k, v in saved.items())
    return str(raised.value), took, same


@pytest.mark.parametrize("fails", ["rename", "write_text"])
def test_a_failure_on_the_first_rank_raises_on_every_rank_at_once(ranks, tmp_path, fails):
    results = ranks.run(check_a_first_rank_failure_raises_everywhere,
                        path=str(tmp_path / "ckpt"), fails=fails)
    assert len({message for message, _, _ in results}) == 1, results
    assert "Directory not empty" in results[0][0]
    assert all(took < 20 for _, took, _ in results) and all(same for _, _, same in results)


def check_a_save_killed_between_its_renames(
    path: str,
) -> tuple[int | None, list[str], int | None, bool]:
    """The state a kill between the two renames leaves: the previous checkpoint at
    `<path>.replaced`, nothing at `path`. It loads (with a warning); the next save puts a
    checkpoint at `path` and the previous one away."""
    model, optim = new_run(seed=0)
    train(model, optim, range(1))
    save_checkpoint(path, model, optim, step=1)
    dist.barrier()
    if dist.get_rank() == 0:
        Path(path).rename(path + ".replaced")
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = load_checkpoint(path, model, optim)
    save_checkpoint(path, model, optim, step=3)
    again = load_checkpoint(path, model, optim)
    return first, [str(w.message) for w in caught], again, Path(path + ".replaced").exists()


def test_a_save_killed_between_its_renames_leaves_a_loadable_checkpoint(ranks, tmp_path):
    for first, warned, again, leftover in ranks.run(check_a_save_killed_between_its_renames,
                                                    path=str(tmp_path / "ckpt")):
        assert first == 1 and again == 3 and not leftover
        assert len(warned) == 1 and "ckpt.replaced" in warned[0], warned
