"""torch's fully_shard all-gather extension: a parameter whose local shard defines
`fsdp_pre_all_gather` and `fsdp_post_all_gather` (a tensor subclass such as torchao's
quantized-training weights, or hooks attached to one shard) chooses what its unit gathers
and builds its unsharded parameter from what every rank sent.

Note [all-gather extension]: called as torch's fully_shard calls them:
`fsdp_pre_all_gather(mesh)` or `fsdp_pre_all_gather(mesh, outer_size, outer_stride, module,
mp_policy)` (told apart by the number of parameters), with the 1-D shard mesh (HSDP too),
the unsharded size and contiguous stride, the owning module and the mixed precision policy,
returns (all-gather inputs, metadata). Each input is gathered rank after rank on dim 0.
The first `fsdp_post_all_gather(outputs, metadata, param_dtype)` returns the unsharded
tensor and the inner tensors whose storage is freed on reshard; each later one gets
`out=` that unsharded parameter, whose inner tensors have their storage again, and fills
it in place (autograd may have saved it). The outputs are the same tensors every time.
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def has_extension(local: torch.Tensor, where: str) -> bool:
    """Whether `local` (a parameter's local shard) defines the extension; one hook without
    the other is an error. `where` names the parameter in it."""
    pre, post = hasattr(local, PRE), hasattr(local, POST)
    if pre != post:
        raise TypeError(
            f"{where}: its local shard defines {PRE if pre else POST} but not "
            f"{POST if pre else PRE}; define both (torch's fully_shard needs both too)."
        )
    return pre


def carried_problem(where: str, local: torch.Tensor) -> str | None:
    """Why a parameter whose local shard is `local` cannot be gathered: a tensor subclass
    without the hooks could be gathered only by unwrapping it, which would silently train
    without what the subclass does."""
    if has_extension(local, where) or not is_traceable_wrapper_subclass(local):
        return None
    return (
        f"{where} is a {type(local).__name__}, a tensor subclass without {PRE} / {POST}: "
        "gathering its plain data would drop what the subclass does. Give the subclass both "
        "methods (torch's fully_shard all-gather extension) or attach them to the "
        "parameter's local shard before its first gather, or make it a plain tensor before "
        "fully_shard."
    )


class GatherExtension:
    """One parameter's all-gather through its shard's hooks: the bytes it sends, and the
    unsharded tensor built from what every rank sent."""

    def __init__(
        self, fqn: str, module: nn.Module, mesh: DeviceMesh, shape: torch.Size, mp_policy: Any,
    ) -> None:
        self._fqn = fqn
        self._module = module
        self._mesh = mesh  # the 1-D shard mesh
        self._shape = shape
        self._stride = torch.empty(shape, device="meta").stride()
        self._mp_policy = mp_policy
        self._inputs: list[tuple[torch.Size, torch.dtype, int]] = []  # shape, dtype, bytes
        self._metadata: Any = None
        self._outputs: list[torch.Tensor] = []  # flat, (ranks * numel) each; kept
        self._inner: tuple[torch.Tensor, ...] = ()  # the unsharded tensor's, freed on reshard
        self.unsharded: torch.Tensor | None = None  # given as out= once built
        self._pre_function: Any = None  # the pre hook whose parameter count is _pre_count
        self._pre_count = 0

    def encode(self, local: torch.Tensor) -> torch.Tensor:
        """What this rank sends: the pre hook's inputs as bytes, each padded to 8 so that
        it can be viewed in its dtype again."""
        pre = getattr(local, PRE)
        count = self._parameter_count(pre)
        if count == 1:
            inputs, self._metadata = pre(self._mesh)
        elif count == 5:
            inputs, self._metadata = pre(
                self._mesh, self._shape, self._stride, self._module, self._mp_policy
            )
        else:
            raise TypeError(
                f"fsdp_compose: parameter {self._fqn!r}: {PRE} takes {count} parameters; "
                "torch's fully_shard calls it with (mesh) or (mesh, outer_size, outer_stride, "
                "module, mp_policy)."
            )
        specs = [(t.shape, t.dtype, t.numel() * t.element_size()) for t in inputs]
        if self._inputs and specs != self._inputs:
            raise RuntimeError(
                f"fsdp_compose: parameter {self._fqn!r}: {PRE} returned inputs of shapes and "
                f"dtypes {specs}, earlier {self._inputs}; they must stay the same."
            )
        self._inputs = specs
        pieces = [t.contiguous().view(-1).view(torch.uint8) for t in inputs]
        return torch.cat([nn.functional.pad(b, (0, -b.numel() % 8)) for b in pieces])

    def _parameter_count(self, pre: Any) -> int:
        """How many parameters the pre hook takes: read once per hook function (a signature
        costs more than the gather's bookkeeping), not at every gather."""
        function = getattr(pre, "__func__", pre)  # a bound method is made anew at each read
        if function is not self._pre_function:
            self._pre_function, self._pre_count = function, len(inspect.signature(pre).parameters)
        return self._pre_count

    def decode(
        self, rows: torch.Tensor, local: torch.Tensor, param_dtype: torch.dtype,
        requires_grad: bool,
    ) -> nn.Parameter | None:
        """Fill the unsharded parameter from `rows` (ranks, bytes: row r what rank r's
        encode sent) through `local`'s post hook; the first time, build and return it."""
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
        post, metadata, self._metadata = getattr(local, POST), self._metadata, None
        if self.unsharded is not None:
            for inner in self._inner:
                _allocate(inner)
            with torch.no_grad():  # it writes into the parameter autograd holds
                post(views, metadata, param_dtype, out=self.unsharded)
            return None
        with torch.no_grad():
            tensor, self._inner = post(views, metadata, param_dtype)
        # The parameter's own size and stride, as torch's fully_shard makes them (the hook
        # may have built it from padded shards).
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
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def carry_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Hooks attached to a local shard instance (not its class) follow it when the shard
    moves to a new tensor; a hook bound to the old tensor is bound to the new one."""
    for name in (PRE, POST):
        hook = old.__dict__.get(name)
        if hook is None:
            continue
        if isinstance(hook, MethodType) and hook.__self__ is old:
            hook = MethodType(hook.__func__, new)
        new.__dict__[name] = hook
