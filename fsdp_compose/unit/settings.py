"""UnitSettings: everything FSDPModule's setters change (api/setters.py), one field each, in
one object per unit that its parts, its schedule and its root read where they use it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..comm.collectives import CustomComm
from ..param.codec import AllGatherCodec
from ..param.sharded_param import ShardedParam

# A hook run on each reduced gradient buffer before the final division, and the stream it
# runs on (None: the reduce-scatter's).
AllReduceHook = tuple[Callable[[torch.Tensor], None], "torch.Stream | None"]


@dataclasses.dataclass
class UnitSettings:
    """Read where used, never copied. What a setting decides once (a post-forward mesh, a
    reduce group, a layout) is derived by the Unit method its setter calls, and kept there."""

    reshard_after_forward: bool | None  # None: True, but False for a root (hooks.py)
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True  # HSDP
    reduce_scatter_unused_params: bool = False
    gradient_divide_factor: float | None = None  # None: the data-parallel ranks
    force_sum_reduction: bool = False
    keep_unsharded_storage: bool = False  # e.g. CUDA graphs
    separate_reduce_scatter_group: bool = False
    all_reduce_hook: AllReduceHook | None = None
    custom_all_gather: CustomComm | None = None
    custom_reduce_scatter: CustomComm | None = None
    codecs: dict[ShardedParam, AllGatherCodec] = dataclasses.field(default_factory=dict)
    # UnitStates (schedule/iteration.py, a layer above) to start gathering once this unit is.
    forward_prefetch: list[Any] = dataclasses.field(default_factory=list)
    backward_prefetch: list[Any] | None = None  # None: the unit whose forward ended before
    implicit_forward_prefetch: bool = False
    # Read on the root only: the bounds its units share (CommContext), and the event its next
    # forward's gathers wait for once.
    max_all_gathers_in_flight: int = 2
    reduce_scatter_max_input_buffers: int = 1
    post_optim_event: Any = None
