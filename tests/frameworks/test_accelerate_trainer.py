"""The transformers Trainer (accelerate's FSDP2 path) trains bit-identically on fsdp_compose
through the launcher, its script unchanged: hf_trainer_script.py runs twice under torchrun at
2 gloo ranks, once as it is (torch's fully_shard) and once as
`torchrun -m fsdp_compose.run ...`, and both runs log the same loss and grad norm at every
step, end with the same bytes in every parameter, and resume from a checkpoint to those same
bytes. tests/frameworks/cpu_shim.py, in front of the script in both runs, lets accelerate take
its FSDP path on CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks import assert_whose, run_script

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

SCRIPT = str(Path(__file__).with_name("hf_trainer_script.py"))
LAUNCHERS = {"torch": [], "fsdp_compose": ["-m", "fsdp_compose.run"]}
STEPS = 4


def train(impl: str, precision: str, tmp_path: Path) -> dict:
    shim = ["-m", "tests.frameworks.cpu_shim"]  # accelerate's FSDP path on CPU
    return run_script([*LAUNCHERS[impl], *shim], [SCRIPT], precision, STEPS, tmp_path / impl)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_fsdp2_bit_identical_through_launcher(precision, tmp_path):
    torch_run = train("torch", precision, tmp_path)
    ours = train("fsdp_compose", precision, tmp_path)

    # Whose fully_shard ran: torch's in the plain run, fsdp_compose's under the launcher,
    # on the same modules (accelerate's plan: embedding, each layer, [norm, lm_head], root).
    assert_whose(torch_run, ours)
    assert {"<root>", "model.layers.0", "model.layers.1"} <= ours["fsdp_classes"].keys()

    for run in ("uninterrupted", "resumed"):
        theirs, mine = torch_run[run], ours[run]
        assert [s["step"] for s in mine["steps"]] == list(range(1, STEPS + 1))
        assert mine["steps"] == theirs["steps"], run  # loss and grad norm, exactly
        assert mine["params"] == theirs["params"], run  # sum and sha256 of every full tensor
    # It trained, and resuming from the checkpoint ends where the uninterrupted run did.
    steps = ours["uninterrupted"]["steps"]
    assert steps[-1]["loss"] < steps[0]["loss"], steps
    for impl_run in (torch_run, ours):
        assert impl_run["resumed"] == impl_run["uninterrupted"]
