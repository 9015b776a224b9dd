"""Peak tracked memory per rank against torch's fully_shard on the same run (the fake
process group's synchronous collectives make the peaks exact; see tests/peak_memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.models import LINEAR_DIM, LINEAR_LAYERS

ROOT = Path(__file__).resolve().parents[1]


def peaks(loop: str) -> dict[int, list[int]]:
    output = subprocess.run(
        [sys.executable, "-m", "tests.peak_memory", loop],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
    ).stdout
    return {int(world): pair for world, pair in json.loads(output).items()}


def test_peak_at_most_torchs_when_each_step_zeroes_the_gradients():
    for world, (ours, theirs) in peaks("zero_grad").items():
        assert ours <= theirs, (world, ours, theirs)


def test_adding_into_gradients_holds_at_most_one_more_copy_of_the_gradient_shards():
    # A backward that adds into existing .grads keeps its reduced shards apart until it
    # finishes (a backward that raises leaves the earlier gradients as they were).
    for world, (ours, theirs) in peaks("accumulate").items():
        rows = -(-LINEAR_DIM // world)
        gradient_shards = LINEAR_LAYERS * rows * (LINEAR_DIM + 1) * 4
        assert ours <= theirs + gradient_shards, (world, ours, theirs, gradient_shards)
