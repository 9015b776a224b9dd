"""Where the torch versions we support (pyproject.toml's range) differ: the one place that
names a torch version. Elsewhere the package calls what this module exports and runs the
same on every torch in the range."""

from __future__ import annotations

import torch


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version: a source build of 2.15 calls itself
    2.15.0a0+git..., a pre-release that a plain version comparison ranks below 2.15,
    yet its API is 2.15's."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


_TORCH = _release(torch.__version__)


# A process group's flat all-gather and reduce-scatter: torch 2.13 names them
# all_gather_single / reduce_scatter_single, torch 2.11 and 2.12 only _allgather_base /
# _reduce_scatter_base (both record the same ops, c10d::_allgather_base_ and
# c10d::_reduce_scatter_base_). comm/collectives.py calls them as bound methods, never as
# ProcessGroup's unbound ones: a process group written in Python (torch's threaded test
# world) overrides them.
_NEW_COLLECTIVE_NAMES = _TORCH >= (2, 13)
ALL_GATHER_METHOD = "all_gather_single" if _NEW_COLLECTIVE_NAMES else "_allgather_base"
REDUCE_SCATTER_METHOD = (
    "reduce_scatter_single" if _NEW_COLLECTIVE_NAMES else "_reduce_scatter_base"
)


# Without a reduce_dtype, torch's fully_shard reduces gradients in param_dtype up to torch
# 2.14 and in the parameter's own dtype from 2.15 on; we follow the torch we run on, so
# that code moved between the two runtimes reduces alike.
REDUCE_IN_OWN_DTYPE = _TORCH >= (2, 15)

# Note [mesh dims]: the package indexes mesh dims from the front (mesh.size(mesh.ndim - 1),
# never mesh.size(-1)): on torch 2.11 a 1-D mesh made by DeviceMesh._flatten (dp_mesh_dims
# with several shard dims) has a layout that only index 0 reaches, so size(-1) fails with
# an AssertionError. Counting from the front works on every torch.
