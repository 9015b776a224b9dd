"""What fsdp_compose changes for the whole process (comm/process_wide.py) is there only while
a model needs it: nothing at import, the local optimizer step and the unmanaged-parameter
watch once a model is annotated, the watch gone at its first forward, everything gone with
the model, and no record that grows with every model built. In a fresh interpreter, so that
no other test's model is alive."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import gc, importlib, json
import torch, torch.distributed as dist
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compose import fully_shard
from fsdp_compose.comm.process_wide import installed
from fsdp_compose.param.local_step import SHARDED_IDS
from tests.models import MLP

adam = importlib.import_module("torch.optim.adam")
original = (adam.adam, torch.optim.Adam._init_group)
seen = {}

def look(when):
    seen[when] = {
        "installed": installed(), "ids": len(SHARDED_IDS),
        "adam wrapped": (adam.adam, torch.optim.Adam._init_group) != original,
        "optimizer hooks": len(optim_module._global_optimizer_pre_hooks),
        "module hooks": len(nn_module._global_forward_pre_hooks),
    }

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
look("imported")
def annotated():
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)

for i in range(3):
    model = annotated()
    optimizer = torch.optim.Adam(model.parameters())
    look(f"annotated {i}")
    seen["parameters"] = len(list(model.parameters()))
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    look(f"trained {i}")
    del model, optimizer
    gc.collect()
    look(f"gone {i}")
print(json.dumps(seen))
"""


def test_process_wide_pieces_live_with_the_models_that_need_them() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.splitlines()[-1])
    nothing = {"installed": [], "ids": 0, "adam wrapped": False, "optimizer hooks": 0,
               "module hooks": 0}
    assert seen["imported"] == nothing
    for i in range(3):
        annotated, trained = seen[f"annotated {i}"], seen[f"trained {i}"]
        assert annotated["installed"] == [
            "local optimizer step (torch.optim wrapped, an optimizer pre-hook)",
            "unmanaged-parameter watch (a module forward pre-hook)",
        ]
        assert annotated["adam wrapped"] and annotated["optimizer hooks"] == 1
        assert annotated["module hooks"] == 1 and annotated["ids"] == seen["parameters"]
        assert trained == {**annotated, "installed": annotated["installed"][:1], "module hooks": 0}
        assert seen[f"gone {i}"] == nothing
