"""Loading a checkpoint never unpickles anything but checkpoint metadata."""

from __future__ import annotations

import os
import pickle

import pytest
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
