"""torch's fully_shard all-gather extension, the one way to change what a gather sends: a
parameter whose local shard defines `fsdp_pre_all_gather` and `fsdp_post_all_gather` (a tensor
subclass, e.g. torchao's, or hooks attached to one shard), or that has a codec (param/codec.py,
whose CodecHooks define both), chooses what its unit gathers and builds its unsharded parameter."""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Note [all-gather extension]: called as torch's fully_shard calls them.
# `fsdp_pre_all_gather(mesh)` or `(mesh, outer_size, outer_stride, module, mp_policy)` (by its
# number of parameters; the 1-D shard mesh) returns (all-gather inputs, metadata); each input
# is gathered rank after rank on dim 0. The first `fsdp_post_all_gather(outputs, metadata,
# param_dtype)` returns the unsharded tensor and the inner tensors freed on reshard; each later
# call fills that tensor in place, given as `out=` (autograd may have saved it), from the same
# output tensors.
PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def has_extension(local: torch.Tensor, where: str) -> bool:
    """Whether `local` (a parameter's local shard) defines both hooks; only one is an error."""
    pre, post = hasattr(local, PRE), hasattr(local, POST)
    if pre != post:
        raise TypeError(
            f"{where}: its local shard defines {PRE if pre else POST} but not "
            f"{POST if pre else PRE}; define both (torch's fully_shard needs both too)."
        )
    return pre


def carried_problem(where: str, local: torch.Tensor) -> str | None:
    """Why a parameter whose shard `local` has no all-gather hooks cannot be gathered, if so."""
    if not is_traceable_wrapper_subclass(local):
        return None
    return (
        f"{where} is a {type(local).__name__}, a tensor subclass without {PRE} / {POST}: "
        "gathering its plain data would drop what the subclass does. Give the subclass both "
        "methods (torch's fully_shard all-gather extension) or attach them to the parameter's "
        "local shard before its first gather, or make it a plain tensor before fully_shard."
    )


class GatherExtension:
    """One parameter's all-gather through its shard's hooks (Note [all-gather extension])."""

    def __init__(
        self, fqn: str, module: nn.Module, mesh: DeviceMesh, shape: torch.Size, mp_policy: Any,
        hooks: Any = None,
    ) -> None:
        self._fqn = fqn
        self.hooks = hooks  # what defines both hooks; None: the local shard, given each time
        self._shape = shape
        self._stride = torch.empty(shape, device="meta").stride()
        # The pre hook's arguments: the first (the 1-D shard mesh) or all five.
        self._arguments = (mesh, shape, self._stride, module, mp_policy)
        self._inputs: list[tuple[torch.Size, torch.dtype, int]] = []  # shape, dtype, bytes
        self._metadata: Any = None
        self._outputs: list[torch.Tensor] = []  # flat, (ranks * numel) each; kept
        self._inner: tuple[torch.Tensor, ...] = ()  # the unsharded tensor's, freed on reshard
        self.unsharded: torch.Tensor | None = None  # given as out= once built
        self._pre_function: Any = None  # the pre hook whose parameters _pre_count counts
        self._pre_count = 0

    def encode(self, local: torch.Tensor) -> torch.Tensor:
        """What this rank sends: the pre hook's inputs as bytes, each padded to 8 bytes."""
        pre = getattr(local if self.hooks is None else self.hooks, PRE)
        function = getattr(pre, "__func__", pre)  # a bound method is made anew at each read
        if function is not self._pre_function:  # count its parameters once, not every gather
            if (count := len(inspect.signature(pre).parameters)) not in (1, 5):
                raise TypeError(
                    f"fsdp_compose: parameter {self._fqn!r}: {PRE} takes {count} parameters; "
                    "torch's fully_shard calls it with (mesh) or (mesh, outer_size, "
                    "outer_stride, module, mp_policy)."
                )
            self._pre_function, self._pre_count = function, count
        inputs, self._metadata = pre(*self._arguments[: self._pre_count])
        specs = [(t.shape, t.dtype, t.numel() * t.element_size()) for t in inputs]
        if self._inputs and specs != self._inputs:
            raise RuntimeError(
                f"fsdp_compose: parameter {self._fqn!r}: {PRE} returned inputs of shapes and "
                f"dtypes {specs}, earlier {self._inputs}; they must stay the same."
            )
        self._inputs = specs
        pieces = [t.contiguous().view(-1).view(torch.uint8) for t in inputs]
        return torch.cat([nn.functional.pad(b, (0, -b.numel() % 8)) for b in pieces])

    def decode(
        self, rows: torch.Tensor, local: torch.Tensor, param_dtype: torch.dtype, requires_grad: bool
    ) -> nn.Parameter | None:
        """Fill the unsharded parameter from `rows` (row r: rank r's); the first time, return it."""
        ranks, offset, views = rows.shape[0], 0, []
        if not self._outputs:
            self._outputs = [
                torch.empty(ranks * (nbytes // dtype.itemsize), dtype=dtype, device=rows.device)
                for _, dtype, nbytes in self._inputs
            ]
        for output, (shape, dtype, nbytes) in zip(self._outputs, self._inputs):
            _allocate(output)
            output.view(ranks, -1).copy_(rows[:, offset : offset + nbytes].view(dtype))
            offset += nbytes + -nbytes % 8
            views.append(output.view(-1, *shape[1:]))
        post = getattr(local if self.hooks is None else self.hooks, POST)
        metadata, self._metadata = self._metadata, None
        if self.unsharded is not None:
            for inner in self._inner:
                _allocate(inner)
            with torch.no_grad():  # it writes into the parameter autograd holds
                post(views, metadata, param_dtype, out=self.unsharded)
            return None
        with torch.no_grad():
            tensor, self._inner = post(views, metadata, param_dtype)
        # The parameter's own size and stride (the hook may have built it from padded shards).
        whole = torch.as_strided(tensor, self._shape, self._stride, storage_offset=0)
        self.unsharded = nn.Parameter(whole, requires_grad=requires_grad)
        return self.unsharded

    def free(self) -> None:
        """Free the outputs' and the unsharded tensor's storage (kept as objects)."""
        for tensor in (*self._outputs, *self._inner):
            tensor.untyped_storage().resize_(0)


def _allocate(tensor: torch.Tensor) -> None:
    """Give a freed tensor its storage back (uninitialised)."""
    nbytes = tensor.numel() * tensor.element_size()
    if (storage := tensor.untyped_storage()).nbytes() != nbytes:
        storage.resize_(nbytes)


def carry_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Move hooks attached to the shard `old` (not its class) to `new`, rebinding bound ones."""
    for name in (PRE, POST):
        hook = old.__dict__.get(name)
        if isinstance(hook, MethodType) and hook.__self__ is old:
            hook = MethodType(hook.__func__, new)
        if hook is not None:
            new.__dict__[name] = hook
