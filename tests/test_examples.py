"""Each example runs as documented, with its defaults, and its loss goes down; a rank killed
mid-training resumes from the last checkpoint and ends bit-identical."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
TRAIN_GPT = str(ROOT / "examples" / "train_gpt.py")


def test_train_gpt_loss_goes_down(tmp_path):
    result = subprocess.run(
        [*TORCHRUN, TRAIN_GPT, "--steps", "12", "--trace", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 12, result.stdout
    assert losses[-1] < 0.7 * losses[0], losses
    # --trace: the last step's table (a row per block and pass) and both ranks' Chrome trace.
    assert len(re.findall(r"^(forward|backward)\s+blocks\.\d", result.stdout, re.MULTILINE)) == 8
    events = json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: parent pid
                found.append(int(entry))
    return found


def _kill_all(pid: int) -> None:
    for process in [*_children(pid), pid]:
        os.kill(process, signal.SIGKILL)


def test_killed_rank_resumes_from_checkpoint_bit_identical(tmp_path):
    args = ["--steps", "12", "--save-every", "3"]
    uninterrupted = tmp_path / "uninterrupted.safetensors"
    subprocess.run([*TORCHRUN, TRAIN_GPT, *args, "--export", str(uninterrupted)],
                   check=True, capture_output=True, timeout=300, cwd=ROOT)

    resumed = tmp_path / "resumed.safetensors"
    job = subprocess.Popen(
        [*TORCHRUN, "--max-restarts=1", TRAIN_GPT, *args, "--export", str(resumed),
         "--checkpoint", str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        # Workers sharing the agent's rendezvous store can read a dead peer's address after
        # a restart (pytorch/pytorch#135712); a store of their own per attempt avoids it.
        env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    # If the job hangs, kill the workers too: they hold the pipe the loop below reads.
    watchdog = threading.Timer(300, _kill_all, [job.pid])
    watchdog.start()
    output, killed = [], None
    for line in job.stdout:
        output.append(line)
        if killed is None and line.startswith("step   7"):
            killed = _children(job.pid)[-1]  # a worker of the torchrun agent
            os.kill(killed, signal.SIGKILL)
    watchdog.cancel()
    assert job.wait() == 0 and killed is not None, "".join(output)
    text = "".join(output)
    assert re.search(r"resumed from .* at step (6|9)\n", text), text

    expected, got = load_file(uninterrupted), load_file(resumed)
    assert sorted(got) == sorted(expected)
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key


def test_train_hf_llama_loss_goes_down_and_exports_a_loadable_checkpoint(tmp_path):
    from transformers import LlamaForCausalLM

    result = subprocess.run(
        [*TORCHRUN, str(ROOT / "examples" / "train_hf_llama.py"), "--steps", "12",
         "--export", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 12, result.stdout
    assert losses[-1] < 0.7 * losses[0], losses
    model, info = LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    tokens = (torch.arange(32) % 128).unsqueeze(0)  # a counting sequence, as trained on
    with torch.no_grad():
        assert model(input_ids=tokens, labels=tokens).loss < losses[0]
