"""Loading a checkpoint never unpickles anything but checkpoint metadata."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from fsdp_compose import load_checkpoint


class RunsACommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_metadata_with_arbitrary_objects_is_refused(tmp_path):
    marker = tmp_path / "ran"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsACommand(str(marker))))
    with pytest.raises(ValueError, match=r"\.metadata' is damaged or truncated \(UnpicklingError: "
                       r".*asks for posix\.system, which is not checkpoint metadata; refusing"):
        load_checkpoint(checkpoint, nn.Linear(2, 2))
    assert not marker.exists()


@pytest.mark.parametrize("saved_by", ["pathlib", "pathlib._local"])  # Python < 3.13, 3.13
def test_metadata_pickled_by_any_python_loads(tmp_path, saved_by):
    """A checkpoint's metadata holds its path, pickled under the module Python defines
    PosixPath in (pathlib._local from 3.13): a checkpoint saved on one loads on the other."""
    import torch.distributed as dist

    from fsdp_compose import save_checkpoint

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        save_checkpoint(tmp_path / "ckpt", model, step=5)
        metadata = tmp_path / "ckpt" / ".metadata"
        # Protocol 2 writes each class as text ("c<module>\n<name>\n"), without frames.
        data = pickle.dumps(pickle.loads(metadata.read_bytes()), protocol=2)
        spellings = (b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
        path_class = [n for n in spellings if n in data]
        assert path_class, "the metadata pickles no path"
        metadata.write_bytes(data.replace(path_class[0], b"c%s\nPosixPath\n" % saved_by.encode()))
        fresh = nn.Linear(3, 2)
        assert load_checkpoint(tmp_path / "ckpt", fresh) == 5
        assert torch.equal(fresh.weight, model.weight)
    finally:
        dist.destroy_process_group()
