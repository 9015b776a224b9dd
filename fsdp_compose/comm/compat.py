"""Where the torch versions we support (pyproject.toml's range) differ: the one place that
names a torch version. Elsewhere the package runs the same on every torch in the range."""

from __future__ import annotations

import torch


def _release(version: str) -> tuple[int, int]:
    """(major, minor): a source build 2.15.0a0+git... has 2.15's API, though it sorts below."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


_TORCH = _release(torch.__version__)

# A process group's flat all-gather and reduce-scatter: all_gather_single and
# reduce_scatter_single from torch 2.13, _allgather_base and _reduce_scatter_base before
# (the same ops). Called as bound methods: a process group written in Python overrides them.
_NEW_COLLECTIVE_NAMES = _TORCH >= (2, 13)
ALL_GATHER_METHOD = "all_gather_single" if _NEW_COLLECTIVE_NAMES else "_allgather_base"
REDUCE_SCATTER_METHOD = "reduce_scatter_single" if _NEW_COLLECTIVE_NAMES else "_reduce_scatter_base"

# Without a reduce_dtype, torch's fully_shard reduces gradients in param_dtype up to torch
# 2.14 and in the parameter's own dtype from 2.15 on; we follow the torch we run on.
REDUCE_IN_OWN_DTYPE = _TORCH >= (2, 15)

# Note [mesh dims]: the package indexes mesh dims from the front (mesh.size(mesh.ndim - 1),
# never mesh.size(-1)): on torch 2.11 a 1-D mesh made by DeviceMesh._flatten only index 0
# reaches, so size(-1) fails with an AssertionError.
