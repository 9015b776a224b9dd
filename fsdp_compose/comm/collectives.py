"""Every collective fsdp_compose sends, and the buffers a unit's reuse: one all-gather of a
unit's padded shards, one reduce-scatter of its padded gradients (an all-reduce across HSDP replicas; broadcasts when
syncing from the first rank, all-reduces of norms when clipping, barriers around
checkpoint renames, one gather of model fingerprints at the first forward). Nothing else
in the package calls torch.distributed collectives, so this file shows all we put on the
wire (custom comms a user sets excepted)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,  # where torch.distributed has it from
    _make_nccl_premul_sum,
)
from torch.distributed import ProcessGroup, ReduceOp

from .compat import ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD


class GradReduction(NamedTuple):
    """How a unit's gradients are averaged: scale before, reduce-scatter with `op` in the
    shard group, all-reduce with `all_reduce_op` across replicas (HSDP), divide after."""

    pre_scale: float | None
    op: ReduceOp.RedOpType | ReduceOp  # a ReduceOp: PREMUL_SUM with its factor
    all_reduce_op: ReduceOp.RedOpType
    post_divide: float | None
    # The process group's options for `op`, synchronous and asynchronous, built once:
    # hashing a ReduceOp to look them up per call costs more than the rest of the call.
    scatter_options: tuple[dist.ReduceScatterOptions, ...] = ()


def _reduction(
    pre_scale: float | None, op: ReduceOp.RedOpType | ReduceOp, all_reduce_op: ReduceOp.RedOpType,
    post_divide: float | None,
) -> GradReduction:
    options = tuple(_reduce_scatter_options(op, async_op) for async_op in (False, True))
    return GradReduction(pre_scale, op, all_reduce_op, post_divide, options)


@functools.cache  # a unit asks at every reduction, with the same arguments
def grad_reduction(
    shard_size: int, replicate_size: int, dtype: torch.dtype, divide_factor: float | None,
    force_sum: bool, premul_sum: bool = False,
) -> GradReduction:
    """The reduction that divides summed gradients by `divide_factor` (default: the number
    of data-parallel ranks, shard_size * replicate_size).

    The backend's own AVG is cheapest; a custom factor is ReduceOp.PREMUL_SUM where the
    backend has it (`premul_sum`: NCCL fuses the scaling into the reduce-scatter), else a
    pre-scaled SUM, its math (gloo); `force_sum` keeps the wire op a plain SUM and divides
    afterwards. In float16, whose range is narrow, the division is split around the SUM
    (about sqrt(factor) before, the rest after) so neither the sum overflows nor the
    pre-scaled gradients underflow. The same choices as torch's fully_shard.
    """
    ranks = shard_size * replicate_size
    factor = float(ranks) if divide_factor is None else float(divide_factor)
    sum_ = ReduceOp.SUM
    if dtype in (torch.float32, torch.bfloat16) and not force_sum:
        if divide_factor is None:
            # A group of one has nothing to average; some backends mishandle AVG there.
            op = sum_ if ranks == 1 else ReduceOp.AVG
            return _reduction(None, op, op, None)
        if factor == shard_size:
            return _reduction(None, ReduceOp.AVG, sum_, None)
        if premul_sum:  # private: the constructor of a factored op every torch in range has
            return _reduction(None, _make_nccl_premul_sum(1.0 / factor), sum_, None)
        return _reduction(1.0 / factor, sum_, sum_, None)
    if dtype in (torch.float32, torch.bfloat16):
        return _reduction(None, sum_, sum_, factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    post = factor / pre
    return _reduction(1.0 / pre if pre != 1 else None, sum_, sum_, post if post != 1 else None)


# Backends whose reduce-scatter takes ReduceOp.PREMUL_SUM (gloo refuses it).
_PREMUL_SUM_BACKENDS = frozenset({"nccl"})


def has_premul_sum(group: ProcessGroup) -> bool:
    """Whether `group`'s backend reduces with ReduceOp.PREMUL_SUM."""
    return dist.get_backend(group) in _PREMUL_SUM_BACKENDS


class ReusedBuffer:
    """One tensor (the rows of a collective) whose storage exists only between `take` and
    `release`.

    A unit gathers and reduces the same sizes at every step; resizing one tensor's storage
    is cheaper than constructing a new tensor, and freeing it after each use keeps the
    memory what fresh buffers would take.
    """

    __slots__ = ("_nbytes", "_spec", "_taken", "flat")
    flat: torch.Tensor  # the taken tensor, 1-D (a view, made once): set by the first take

    def __init__(self) -> None:
        # The tensor and its storage, kept together once made.
        self._taken: tuple[torch.Tensor, torch.UntypedStorage] | None = None
        self._nbytes = 0
        self._spec: tuple[tuple[int, int], torch.dtype, torch.device] | None = None

    def take(
        self, spec: tuple[tuple[int, int], torch.dtype, torch.device]
    ) -> torch.Tensor:
        """A contiguous tensor of `spec` (shape: rows of a collective; dtype; device),
        uninitialised, until `release`. Callers pass the same spec object each time when
        they can: it is checked by identity first."""
        if self._taken is None or (spec is not self._spec and spec != self._spec):
            shape, dtype, device = spec
            # Not an inference tensor, whichever mode the first use runs in.
            with torch.inference_mode(False):
                tensor = torch.empty(shape, dtype=dtype, device=device)
            self.flat = tensor.view(-1)
            self._taken = tensor, tensor.untyped_storage()
            self._nbytes, self._spec = tensor.nbytes, spec
            return tensor
        tensor, storage = self._taken
        storage.resize_(self._nbytes)
        return tensor

    def nbytes(self) -> int:
        """What its storage holds now (0 when released)."""
        return 0 if self._taken is None else self._taken[1].nbytes()

    def release(self) -> None:
        """Free the storage; what `take` returned must no longer be in use."""
        if self._taken is not None:
            self._taken[1].resize_(0)


# A user's all-gather or reduce-scatter for one unit (FSDPModule.set_custom_all_gather /
# set_custom_reduce_scatter), with torch's fully_shard interface: called like the functions
# below take their tensors, `comm(output, input, group, async_op=False)` and
# `comm(output, input, group, op, async_op=False)`, returning a Work or None; an
# `allocate(size, *, dtype, device)` method, if any, allocates its buffers.
CustomComm = Callable[..., "dist.Work | None"]


def allocate(
    comm: CustomComm | None, size: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A communication buffer, from the custom comm's allocator when it has one."""
    if comm is not None and hasattr(comm, "allocate"):
        buffer: torch.Tensor = comm.allocate(size, dtype=dtype, device=device)
        return buffer
    return torch.empty(size, dtype=dtype, device=device)


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, ranks: int, async_op: bool,
    custom: CustomComm | None = None,
) -> dist.Work | None:
    """Gather every rank's equal-sized flat `shard` into `output`, rank after rank, over
    `group` of `ranks` ranks.

    The caller passes what it knows already (group size; complex tensors as real pairs,
    as torch.distributed sends them): asking the group or the tensors costs more, per
    call, than the rest of a unit's unshard.
    """
    if custom is not None:
        work = custom(output, shard, group, async_op=async_op)
    elif ranks == 1:
        output.copy_(shard)  # replicate-only units and single-rank meshes send nothing
        return None
    else:
        # The process group's own method, which dist.all_gather_single calls after checks
        # that cost more than the rest of a unit's unshard (our tensors are flat and ours).
        work = getattr(group, ALL_GATHER_METHOD)(output, shard, _ALL_GATHER_OPTIONS[async_op])
    if async_op:
        return work
    _waited(work)
    return None


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, ranks: int,
    reduction: GradReduction, custom: CustomComm | None = None, async_op: bool = True,
) -> dist.Work | None:
    """Reduce `input` (flat, block r: the values for rank r) across `group` of `ranks`
    ranks; rank r keeps block r in `output`. Applies the pre-scale; the post-divide is the
    caller's, after any all-reduce. With `async_op`, returns the Work to wait for (None:
    done). Arguments as in all_gather."""
    if reduction.pre_scale is not None:
        input.mul_(reduction.pre_scale)
    if custom is not None:
        work = custom(output, input, group, reduction.op, async_op=async_op)
    elif ranks == 1:
        output.copy_(input)
        return None
    else:
        options = reduction.scatter_options[async_op]
        work = getattr(group, REDUCE_SCATTER_METHOD)(output, input, options)
    if async_op:
        return work
    _waited(work)
    return None


def _waited(work: dist.Work | None) -> None:
    """Wait for `work` (None: done already); a synchronous caller returns None after."""
    if work is not None:
        work.wait()


def _all_gather_options(async_op: bool) -> AllgatherOptions:
    options = AllgatherOptions()
    options.asyncOp = async_op
    return options


# The options of our calls, built once (the process group only reads them): synchronous
# and asynchronous, indexed by async_op.
_ALL_GATHER_OPTIONS = (_all_gather_options(False), _all_gather_options(True))


def _reduce_scatter_options(
    op: ReduceOp.RedOpType | ReduceOp, async_op: bool
) -> dist.ReduceScatterOptions:
    options = dist.ReduceScatterOptions()
    options.reduceOp = op if isinstance(op, ReduceOp) else ReduceOp(op)  # as assigning converts
    options.asyncOp = async_op
    return options


def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType, group: ProcessGroup) -> None:
    """Reduce `tensor` in place across `group`."""
    dist.all_reduce(tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, group: ProcessGroup) -> None:
    """Overwrite `tensor` with the group's first rank's."""
    if group.size() > 1:
        dist.broadcast(tensor, group=group, group_src=0)


def all_gather_object(obj: object, group: ProcessGroup) -> list[object]:
    """Every rank's `obj`, by group rank (pickled: for small, once-only checks)."""
    gathered: list[object] = [None] * group.size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


T = TypeVar("T")


def every_rank(obj: T) -> list[T]:
    """Every rank's `obj`, by rank, over the default group (pickled: for small, once-per-
    call verdicts); `[obj]` without a process group."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[T | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return cast("list[T]", gathered)


def broadcast_object(obj: T) -> T:
    """The first rank's `obj` on every rank (pickled: for small, once-per-call verdicts);
    `obj` itself without a process group."""
    if not dist.is_initialized():
        return obj
    shared: list[T] = [obj]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def is_first_rank() -> bool:
    """Whether this is the rank that writes files (the only one without a process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every rank (checkpoint files are renamed in between)."""
    if dist.is_initialized():
        dist.barrier()


def collective_failed(unit: str, collective: str, ranks: int, error: RuntimeError) -> RuntimeError:
    """The error to raise from `error`, raised by a collective (e.g. timed out): which unit
    and collective it was, and where to look. Raised from an `except` around the call,
    which costs nothing while nothing fails."""
    return RuntimeError(
        f"fsdp_compose: the {collective} of unit {unit} over {ranks} ranks failed on rank "
        f"{dist.get_rank()}: {error}\nAnother rank probably raised or stopped before this "
        "collective: look for its error. How long a rank waits is the process group's "
        "timeout: init_process_group(..., timeout=datetime.timedelta(minutes=...))."
    )
