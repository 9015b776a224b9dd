"""PyTorch Lightning (ModelParallelStrategy, a LightningModule whose configure_model calls
torch.distributed.fsdp.fully_shard, imported at the script's top) trains bit-identically on
fsdp_compose through the launcher, its script unchanged: lightning_script.py runs twice under
torchrun at 2 gloo ranks, once as it is (torch's fully_shard) and once as
`torchrun -m fsdp_compose.run lightning_script.py ...`, and both runs have the same loss and
full-gradient sum at every step, end with the same bytes in every parameter, and resume from
a distributed checkpoint to those same bytes. Optional: skipped without lightning.

The torch run goes through tests/frameworks/cpu_shim.py, which there does only the check of
the checks' shift (when FSDP_COMPOSE_TEST_SHIFT_TORCH is set); Lightning runs on CPU as it is.
Under torchrun Lightning starts no processes of its own. Started by Lightning itself
(`python -m fsdp_compose.run script.py` with Trainer(devices=2)), its other ranks would run
`python script.py`, without the launcher, on torch's fully_shard: not supported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks import assert_whose, run_script

pytest.importorskip("lightning")

SCRIPT = str(Path(__file__).with_name("lightning_script.py"))
LAUNCHERS = {
    "torch": ["-m", "tests.frameworks.cpu_shim"],
    "fsdp_compose": ["-m", "fsdp_compose.run"],
}
STEPS = 4


def train(impl: str, precision: str, tmp_path: Path) -> dict:
    return run_script(LAUNCHERS[impl], [SCRIPT], precision, STEPS, tmp_path / impl)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lightning_fsdp2_bit_identical_through_launcher(precision, tmp_path):
    torch_run = train("torch", precision, tmp_path)
    ours = train("fsdp_compose", precision, tmp_path)

    # Whose fully_shard ran: the name the script imported at its top was fsdp_compose's
    # under the launcher (it switches before the script runs), on the same modules.
    assert_whose(torch_run, ours)
    assert ours["fsdp_classes"].keys() == {"<root>", "blocks.0", "blocks.1"}

    uninterrupted = ours["uninterrupted"]["steps"]
    assert [s["step"] for s in uninterrupted] == list(range(1, STEPS + 1))
    assert [s["step"] for s in ours["resumed"]["steps"]] == list(range(3, STEPS + 1))
    for run in ("uninterrupted", "resumed"):
        assert ours[run]["steps"] == torch_run[run]["steps"], run  # loss, gradient sum: exactly
        assert ours[run]["params"] == torch_run[run]["params"], run  # sum, sha256 of each
    # It trained, and resuming from step 2's checkpoint ends where the uninterrupted run did.
    assert uninterrupted[-1]["loss"] < uninterrupted[0]["loss"], uninterrupted
    for impl_run in (torch_run, ours):
        assert impl_run["resumed"]["steps"] == impl_run["uninterrupted"]["steps"][2:]
        assert impl_run["resumed"]["params"] == impl_run["uninterrupted"]["params"]
