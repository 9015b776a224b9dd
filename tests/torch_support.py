"""What the torch under test offers of its own fully_shard, where tests use it as their
reference or build its types. fsdp_compose runs the same on every torch in its range
(fsdp_compose/comm/compat.py); the reference does not, so a test narrows its comparison
or skips here, by what torch has, and says why."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.torch_version import TorchVersion

from fsdp_compose import fully_shard

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # torch 2.11, 2.12
    ShardPlacementResult = None

needs_shard_placement_result = pytest.mark.skipif(
    ShardPlacementResult is None,
    reason="torch's ShardPlacementResult (shard_placement_fn putting parameters on a mesh of "
    "their own) arrives in torch 2.13",
)

# torch 2.11's fully_shard fails torchtitan's chunked loss (a list unit's head run once per
# chunk, kept unsharded): the trunk's backward raises "The tensor has a non-zero number of
# elements, but its data is not allocated yet".
TORCH_RUNS_CHUNKED_LOSS = TorchVersion(torch.__version__) >= "2.13"


def versus_torch(*methods: str) -> tuple[object, object]:
    """`shard_fns` for parity.train_and_compare in a test that calls FSDPModule `methods`:
    ours and torch's fully_shard, or ours twice where torch's FSDPModule lacks one of them
    (an older torch). The single-process reference is then the comparison that remains."""
    if all(hasattr(TorchFSDPModule, method) for method in methods):
        return fully_shard, torch_fully_shard
    return fully_shard, fully_shard
