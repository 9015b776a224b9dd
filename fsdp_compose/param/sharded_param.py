"""One parameter: its sharded DTensor, its unsharded tensor, and the swap between the two."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..comm.compat import REDUCE_IN_OWN_DTYPE
from ..comm.meshes import UnitMesh
from .extension import GatherExtension, carry_hooks
from .local_step import Tracked
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy
from .replaced import warn_copied
from .sharding import ShardLayout, contiguous_stride, shard_layout
from .tensor_parallel import TensorParallel


class Registration(NamedTuple):
    """One owner's attribute for a parameter, and the parameter's forms to put there."""

    parameters: dict[str, nn.Parameter | None]  # the owner's _parameters
    name: str
    sharded: nn.Parameter
    unsharded: nn.Parameter


class ShardedParam:
    """A parameter sharded on one dim, registered on its module(s) in one form or the other.

    `sharded`: the `nn.Parameter(DTensor)` the optimizer steps on, a view of `padded_shard`
    (zero padding; CPU memory with offload). `unsharded`: the one in `param_dtype` forward and
    backward use, a view of `unsharded_buffer`, whose storage exists only while unsharded."""

    def __init__(
        self, fqn: str, param: nn.Parameter, owners: list[tuple[nn.Module, str]], mesh: UnitMesh,
        mp_policy: MixedPrecisionPolicy, offload: CPUOffloadPolicy | None = None, dim: int = 0,
    ) -> None:
        self._tracked = Tracked(self)  # optimizers step on its local tensor
        self.fqn = fqn
        self.owners = owners  # every (module, attribute) the parameter is registered as
        self._home = (owners[0][0]._parameters, owners[0][1])  # where adopt_registered looks
        self.mp_policy = mp_policy
        device = self._device = mesh.device  # where the unit computes
        self._shard_device = torch.device("cpu") if offload is not None else device
        self._pin_memory = bool(offload and offload.pin_memory and torch.accelerator.is_available())
        # A tensor-parallel DTensor: we shard its local tensor (Note [tensor parallel]).
        self._tp = TensorParallel.of(param, mesh.spmd) if isinstance(param, DTensor) else None
        self.is_tensor_parallel = self._tp is not None
        # (param is a DTensor when _tp is set)
        whole = self._tp.local(param) if self._tp is not None else param.detach()  # type: ignore[arg-type]
        self.layout: ShardLayout = shard_layout(whole.shape, mesh.shard_size, dim)
        self._local_shape = self.layout.local_shape(mesh.shard_rank)
        self._local_stride = contiguous_stride(self._local_shape)
        self._chunk = self.layout.chunk(mesh.shard_rank)
        placements = (*mesh.placements[:-1], Shard(dim))
        shape = self.layout.shape
        self._spec = (self._tp.sharded_spec(mesh.mesh, placements, dim) if self._tp is not None
                      else (mesh.mesh, placements, shape, contiguous_stride(shape)))
        self.shape: torch.Size = self._spec[2]  # a tensor-parallel parameter's global shape
        # What this rank built, for the first forward's check that the ranks built the same.
        unread = whole.is_meta or is_traceable_wrapper_subclass(whole)
        self.built = None if unread else checksum(whole)
        self._store_shard(self._mine(whole), param.requires_grad)

    def _mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `whole` (of the TP-local shape) on the shard dim."""
        return whole.narrow(self.layout.dim, self._chunk.start, len(self._chunk))

    def _store_shard(self, local: torch.Tensor, requires_grad: bool,
                     keep: nn.Parameter | None = None) -> None:
        """Make `local` (this rank's slice) the shard, in the parameter object `keep` if given."""
        # Set by the unit while the local shard has all-gather hooks: looked for again.
        self.extension: GatherExtension | None = None
        numel = self.layout.padded_shard_numel
        self.padded_shard = zeroed_shard(local, numel, self._shard_device, self._pin_memory)
        view = self.padded_shard[: self._local_shape.numel()].view(self._local_shape)
        if not local.is_meta:
            view.copy_(local)
        sharded = nn.Parameter(self._as_dtensor(view), requires_grad=requires_grad)
        if keep is not None:
            give_data(keep, sharded)
            sharded = keep
        self.sharded: nn.Parameter = sharded
        self._tracked.sharded(sharded)
        self.local = local_of(sharded)  # a detached alias of the view: Parameter() detaches
        carry_hooks(local, self.local)
        self.param_dtype = self.mp_policy.param_dtype or local.dtype
        own = local.dtype if REDUCE_IN_OWN_DTYPE else self.param_dtype
        self.reduce_dtype = self.mp_policy.reduce_dtype or own
        self.allocate_unsharded_buffer(local.device if local.is_meta else self._device)

    def allocate_unsharded_buffer(self, device: torch.device) -> None:
        """Unsharded data of its own, its storage freed (the unit allocates it to gather)."""
        numel = self.layout.shard_size * self.layout.padded_shard_numel
        buffer = torch.empty(numel, dtype=self.param_dtype, device=device)
        self.use_unsharded_buffer(buffer)
        buffer.untyped_storage().resize_(0)

    def use_unsharded_buffer(self, buffer: torch.Tensor) -> None:
        """Keep the unsharded data in `buffer` (flat and padded, in param_dtype, allocated)."""
        self.unsharded_buffer = buffer  # flat and padded; the unit allocates its storage
        # Note [version counter]: the all-gather writes through `.data`, an alias with its own
        # version counter: writing through the buffer would bump the counter autograd checks
        # on the saved unsharded parameter, and the re-gather would look like an illegal edit.
        self.gather_target = self.layout.rank_rows(buffer.data)
        unsharded = buffer[: self.layout.numel].view(self.layout.shape)
        if self._tp is not None:
            unsharded = self._tp.as_dtensor(unsharded)
        self.unsharded = nn.Parameter(unsharded, requires_grad=self.sharded.requires_grad)

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        mesh, placements, shape, stride = self._spec
        # Not DTensor.from_local, which would copy a CPU-offloaded shard to the mesh's device.
        spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)

    @property
    def is_meta(self) -> bool:
        return self.padded_shard.is_meta

    def materialize(self, unsharded: torch.Tensor) -> None:
        """Keep this rank's slice of `unsharded` (an initialised meta parameter) as the shard."""
        self._store_shard(self._mine(unsharded), self.sharded.requires_grad, keep=self.sharded)

    def shard_of(self, whole: torch.Tensor) -> DTensor:
        """This rank's slice of `whole` (of the parameter's shape), as a DTensor like ours."""
        local = self._tp.slice(whole.detach()) if self._tp is not None else whole.detach()
        return self._as_dtensor(self._mine(local))

    def adopt_registered(self, fqn_prefix: str = "") -> bool:
        """Take back what the module holds if it changed (`.to()`, an assigned DTensor, or a whole
        tensor: copied in, warning of `fqn_prefix + fqn`), follow a freeze; True if stored anew."""
        parameters, attr = self._home
        registered = parameters.get(attr)
        if registered is self.sharded and registered._local_tensor is self.local:  # type: ignore[attr-defined]
            if self.unsharded.requires_grad is not registered.requires_grad:
                self.unsharded.requires_grad_(registered.requires_grad)
            return False
        if registered is self.unsharded:
            return False
        if isinstance(registered, DTensor):
            spec = registered.device_mesh, tuple(registered.placements), registered.shape
            if spec != self._spec[:3]:
                raise ValueError(
                    f"fsdp_compose: parameter {self.fqn!r} was replaced by a DTensor of shape "
                    f"{tuple(registered.shape)} with {registered.placements} on "
                    f"{registered.device_mesh}; expected shape {tuple(self.shape)} with "
                    f"{self._spec[1]} on {self._spec[0]}. Assign a tensor of the original "
                    "shape (whole or sharded like the original)."
                )
            self._store_shard(local_of(registered), registered.requires_grad, keep=registered)
        elif isinstance(registered, torch.Tensor) and registered.shape == self.shape:
            local = self.shard_of(registered).to_local()
            self._store_shard(local, registered.requires_grad, keep=self.sharded)
            warn_copied(fqn_prefix + self.fqn, registered)
        else:
            found = "None" if registered is None else f"shape {tuple(registered.shape)}"
            raise ValueError(
                f"fsdp_compose: parameter {self.fqn!r} was replaced by {found}; expected "
                f"shape {tuple(self.shape)}. Assign a parameter of the original shape, "
                "or annotate a freshly built module."
            )
        self.to_sharded()
        return True

    def to_unsharded(self) -> None:
        """Register the unsharded parameter (its data gathered already)."""
        if self.unsharded.requires_grad != self.sharded.requires_grad:  # frozen since
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        for module, name in self.owners:
            module._parameters[name] = self.unsharded

    def to_sharded(self) -> None:
        """Register the sharded parameter (the unit frees the unsharded storage)."""
        for module, name in self.owners:
            module._parameters[name] = self.sharded

    def registrations(self) -> list[Registration]:
        """Where the parameter is registered, with its current forms (for the unit's swap)."""
        return [Registration(module._parameters, name, self.sharded, self.unsharded)
                for module, name in self.owners]

    def whole_from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The whole parameter (its global shape) from every rank's padded shard, rank after
        rank in `rows`; tensor-parallel, gathered over its tensor-parallel mesh too."""
        layout = self.layout
        if layout.dim == 0 and rows.is_contiguous():  # the parameter, then padding: a view
            flat = rows.reshape(-1)
        else:
            flat = torch.empty(layout.shard_size * layout.padded_shard_numel, dtype=rows.dtype,
                               device=rows.device)
            target = layout.rank_rows(flat)
            target.copy_(rows.reshape(target.shape))
        whole = flat[: layout.numel].view(layout.shape)
        return whole if self._tp is None else self._tp.as_dtensor(whole).full_tensor()

    def pop_unsharded_grad(self) -> torch.Tensor | None:
        """Take this backward's unsharded gradient, as a plain tensor (TP: its local part)."""
        grad = self.unsharded.grad
        if grad is None:
            return None
        self.unsharded.grad = None
        return grad if self._tp is None else self._tp.local(grad)  # type: ignore[arg-type]

    def run_grad_hooks(self) -> None:
        """Run the sharded parameter's post-accumulate-grad hooks (autograd never sees it)."""
        hooks = self.sharded._post_accumulate_grad_hooks
        for hook in tuple(hooks.values()) if hooks else ():
            hook(self.sharded)

    def add_to_grad(self, padded_grad_shard: torch.Tensor) -> None:
        """Add this rank's reduced gradient shard (flat, padded) to `.grad` (None: a view of it)."""
        local = padded_grad_shard.as_strided(self._local_shape, self._local_stride)  # its prefix
        shard = self.padded_shard
        if local.dtype != shard.dtype or local.device != shard.device:
            local = local.to(shard.device, shard.dtype)  # reduce_dtype, or offload to CPU
        if self.sharded.grad is None:  # the parameter's own spec, without from_local's cost
            spec = self.sharded._spec  # type: ignore[attr-defined]  # a Parameter of a DTensor
            self.sharded.grad = DTensor(local, spec, requires_grad=False)
        else:
            local_of(self.sharded.grad).add_(local)


# -- the local tensor, handled so that the objects optimizers, modules and tools hold stay the
# ones the model uses


def zeroed_shard(local: torch.Tensor, numel: int, device: torch.device, pin: bool) -> torch.Tensor:
    """A flat zeroed shard of `numel` elements, of `local`'s class, on `device` (or meta)."""
    if local.is_meta or not is_traceable_wrapper_subclass(local):
        on = local.device if local.is_meta else device
        pin = pin and not local.is_meta
        return torch.zeros(numel, dtype=local.dtype, device=on, pin_memory=pin)
    return local.new_zeros(numel)


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Three sums that tell apart tensors of different values (accumulated wide: no copy)."""
    flat = (torch.view_as_real(tensor) if tensor.is_complex() else tensor).detach().flatten()
    wide = torch.float32 if flat.device.type == "mps" else torch.float64  # MPS has no float64
    return torch.stack([flat.sum(dtype=wide), flat[::3].sum(dtype=wide),
                        torch.linalg.vector_norm(flat, dtype=wide)])


def give_data(kept: nn.Parameter, new: nn.Parameter) -> None:
    """Give `kept` (the object optimizers hold) `new`'s data, in place."""
    # If only the local tensor differs, take it, as torch's fully_shard does: swap_tensors
    # refuses a tensor anything holds a weak reference to (torch's MemTracker does).
    if (kept.dtype, kept.device) == (new.dtype, new.device) and kept._spec == new._spec:  # type: ignore[attr-defined]
        kept._local_tensor = local_of(new)  # type: ignore[attr-defined]
        kept.requires_grad_(new.requires_grad)
        return
    grad = kept.grad  # swap_tensors would move it to the discarded tensor: kept if it fits
    torch.utils.swap_tensors(kept, new)
    if grad is not None and (grad.shape, grad.dtype) == (kept.shape, kept.dtype):
        kept.grad = grad


def local_of(dtensor: torch.Tensor) -> torch.Tensor:
    """The local tensor itself (to_local() makes a view): identity tells our shard from another."""
    local: torch.Tensor = dtensor._local_tensor  # type: ignore[attr-defined]
    return local
