"""Every collective fsdp_compose sends, and the buffers a collective reuses. Nothing else in
the package calls torch.distributed collectives (a user's custom comms excepted)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, _make_nccl_premul_sum
from torch.distributed import ProcessGroup, ReduceOp

from .compat import ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD


class GradReduction(NamedTuple):
    """How a unit's gradients are averaged: scale, reduce-scatter, all-reduce (HSDP), divide."""

    pre_scale: float | None
    op: ReduceOp.RedOpType | ReduceOp  # a ReduceOp: PREMUL_SUM with its factor
    all_reduce_op: ReduceOp.RedOpType
    post_divide: float | None
    scatter_options: tuple[dist.ReduceScatterOptions, ...] = ()  # for `op`, by async_op


def _reduction(
    pre_scale: float | None = None, op: ReduceOp.RedOpType | ReduceOp = ReduceOp.SUM,
    all_reduce_op: ReduceOp.RedOpType = ReduceOp.SUM, post_divide: float | None = None,
) -> GradReduction:
    options = (dist.ReduceScatterOptions(), dist.ReduceScatterOptions())  # by async_op
    for async_op, option in enumerate(options):
        option.reduceOp = op if isinstance(op, ReduceOp) else ReduceOp(op)  # as assigning converts
        option.asyncOp = bool(async_op)
    return GradReduction(pre_scale, op, all_reduce_op, post_divide, options)


@functools.cache  # a unit asks at every reduction, with the same arguments
def grad_reduction(
    shard_size: int, replicate_size: int, dtype: torch.dtype, divide_factor: float | None,
    force_sum: bool, premul_sum: bool = False,
) -> GradReduction:
    """Divide summed gradients by `divide_factor` (default: the ranks) as torch's fully_shard
    does; float16 splits the division around the SUM so it neither overflows nor underflows."""
    ranks = shard_size * replicate_size
    factor = float(ranks) if divide_factor is None else float(divide_factor)
    if dtype not in (torch.float32, torch.bfloat16):
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        post = factor / pre
        return _reduction(1.0 / pre if pre != 1 else None, post_divide=post if post != 1 else None)
    if force_sum:
        return _reduction(post_divide=factor)
    if divide_factor is None:
        # A group of one has nothing to average; some backends mishandle AVG there.
        op = ReduceOp.SUM if ranks == 1 else ReduceOp.AVG
        return _reduction(op=op, all_reduce_op=op)
    if factor == shard_size:
        return _reduction(op=ReduceOp.AVG)
    if premul_sum:  # private: the factored op's constructor every torch in range has
        return _reduction(op=_make_nccl_premul_sum(1.0 / factor))
    return _reduction(1.0 / factor)


# Backends whose reduce-scatter takes ReduceOp.PREMUL_SUM (gloo refuses it).
_PREMUL_SUM_BACKENDS = frozenset({"nccl"})


def has_premul_sum(group: ProcessGroup) -> bool:
    return dist.get_backend(group) in _PREMUL_SUM_BACKENDS


_Spec = tuple[tuple[int, int], torch.dtype, torch.device]  # a tensor's shape, dtype and device


class ReusedBuffer:
    """One tensor (a collective's rows) whose storage exists only between `take` and `release`."""

    __slots__ = ("_taken", "flat")
    flat: torch.Tensor  # the taken tensor, 1-D: set by the first take

    def __init__(self) -> None:
        # The spec taken, its tensor, the tensor's storage and the bytes it holds when taken.
        self._taken: tuple[_Spec, torch.Tensor, torch.UntypedStorage, int] | None = None

    def take(self, spec: _Spec) -> torch.Tensor:
        """An uninitialised tensor of `spec` (shape, dtype, device; best the same object)."""
        taken = self._taken
        if taken is None or (spec is not taken[0] and spec != taken[0]):
            shape, dtype, device = spec
            # Not an inference tensor, whichever mode the first use runs in.
            with torch.inference_mode(False):
                tensor = torch.empty(shape, dtype=dtype, device=device)
            self.flat = tensor.view(-1)
            self._taken = spec, tensor, tensor.untyped_storage(), tensor.nbytes
            return tensor
        _, tensor, storage, nbytes = taken
        storage.resize_(nbytes)
        return tensor

    def nbytes(self) -> int:
        """What its storage holds now (0 when released)."""
        return 0 if self._taken is None else self._taken[2].nbytes()

    def release(self) -> None:
        """Free the storage; what `take` returned must no longer be in use."""
        if self._taken is not None:
            self._taken[2].resize_(0)


# A user's all-gather or reduce-scatter (set_custom_all_gather / set_custom_reduce_scatter),
# torch's interface: `comm(output, input, group[, op], async_op=False)` returns a Work or
# None; an `allocate(size, *, dtype, device)` method, if any, allocates its buffers.
CustomComm = Callable[..., "dist.Work | None"]


def allocate(
    comm: CustomComm | None, size: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A communication buffer, from the custom comm's allocator when it has one."""
    buffer: torch.Tensor = getattr(comm, "allocate", torch.empty)(size, dtype=dtype, device=device)
    return buffer


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, ranks: int, async_op: bool,
    custom: CustomComm | None = None,
) -> dist.Work | None:
    """Gather every rank's flat `shard` (complex: viewed as real) into `output`, rank after
    rank; with `async_op`, return the Work to wait for (None: done)."""
    if custom is not None:
        work = custom(output, shard, group, async_op=async_op)
    elif ranks == 1:
        output.copy_(shard)  # replicate-only units and single-rank meshes send nothing
        return None
    else:  # the group's own method: dist.all_gather_single's checks are for others' tensors
        work = getattr(group, ALL_GATHER_METHOD)(output, shard, _ALL_GATHER_OPTIONS[async_op])
    if work is not None and not async_op:
        work.wait()
    return work if async_op else None


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, ranks: int,
    reduction: GradReduction, custom: CustomComm | None = None, async_op: bool = True,
) -> dist.Work | None:
    """Reduce `input` (block r: rank r's) into `output`, pre-scaled (the caller post-divides)."""
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
    if work is not None and not async_op:
        work.wait()
    return work if async_op else None


_ALL_GATHER_OPTIONS = (AllgatherOptions(), AllgatherOptions())  # by async_op
_ALL_GATHER_OPTIONS[0].asyncOp = False


def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType, group: ProcessGroup) -> None:
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
    """Every rank's `obj`, by rank (pickled); `[obj]` without a process group."""
    if not dist.is_initialized():
        return [obj]
    return cast("list[T]", all_gather_object(obj, dist.group.WORLD))  # type: ignore[arg-type]


def broadcast_object(obj: T) -> T:
    """The first rank's `obj` on every rank (pickled); `obj` without a process group."""
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
    """The error to raise for a collective that failed with `error` (e.g. timed out)."""
    return RuntimeError(
        f"fsdp_compose: the {collective} of unit {unit} over {ranks} ranks failed on rank "
        f"{dist.get_rank()}: {error}\nAnother rank probably raised or stopped before this "
        "collective: look for its error. How long a rank waits is the process group's timeout: "
        "init_process_group(..., timeout=datetime.timedelta(minutes=...)).")
