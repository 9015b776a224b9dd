"""One parameter: its sharded DTensor, its unsharded tensor, and the swap between the two."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..comm.compat import REDUCE_IN_OWN_DTYPE
from ..comm.meshes import UnitMesh
from .extension import GatherExtension, carry_hooks
from .local_step import SHARDED_IDS, install
from .local_tensor import give_data, local_of, zeroed_shard
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
    """A parameter sharded on one dim (0 unless shard_placement_fn says otherwise);
    registered on its module(s) as one form or the other.

    `sharded` is the `nn.Parameter(DTensor)` the optimizer steps on, in the original dtype.
    Its local tensor is a view of `padded_shard`, whose trailing padding stays zero, so the
    all-gather reads the padded shard directly. `unsharded` is a plain `nn.Parameter` in
    `param_dtype` that autograd sees during forward and backward; it is a view of
    `_unsharded_buffer` (row r: rank r's padded shard), whose storage is allocated only
    while the unit is unsharded. Gradients are reduced in `reduce_dtype`.

    With CPU offload the padded shard (and the sharded `.grad`) live in CPU memory, pinned
    when an accelerator is there; the unit copies them to the device to gather. A parameter
    annotated on the meta device keeps meta buffers until `materialize`.
    """

    def __init__(
        self,
        fqn: str,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        mesh: UnitMesh,
        mp_policy: MixedPrecisionPolicy,
        offload: CPUOffloadPolicy | None = None,
        dim: int = 0,
    ) -> None:
        install()  # optimizers holding sharded parameters step on their local tensors
        self.fqn = fqn
        self.owners = owners  # every (module, attribute) the parameter is registered as
        # The first owner's _parameters and attribute: where adopt_registered looks.
        self._home = (owners[0][0]._parameters, owners[0][1])
        self.mp_policy = mp_policy
        device = self._device = mesh.device  # where the unit computes
        # With CPU offload the shard (and so the optimizer step) lives in CPU memory.
        self._shard_device = torch.device("cpu") if offload is not None else device
        self._pin_memory = (
            offload is not None and offload.pin_memory and torch.accelerator.is_available()
        )
        shard_size, rank = mesh.shard_size, mesh.shard_rank
        # A tensor-parallel DTensor: we shard its local tensor (Note [tensor parallel]).
        self._tp = TensorParallel.of(param, mesh.spmd) if isinstance(param, DTensor) else None
        whole = self._tp.local(param) if self._tp is not None else param.detach()  # type: ignore[arg-type]  # a DTensor when _tp is set
        self.layout: ShardLayout = shard_layout(whole.shape, shard_size, dim)
        self._local_shape = self.layout.local_shape(rank)
        self._local_stride = contiguous_stride(self._local_shape)
        self._chunk = self.layout.chunk(rank)
        placements = (*mesh.placements[:-1], Shard(dim))
        if self._tp is None:
            shape = self.layout.shape
            self._spec = (mesh.mesh, placements, shape, contiguous_stride(shape))
        else:
            self._spec = self._tp.sharded_spec(mesh.mesh, placements, dim)
        # Set by the unit while the local shard has all-gather hooks (see param/extension.py).
        self.extension: GatherExtension | None = None
        self.sharded: nn.Parameter = None  # type: ignore[assignment]  # set by _store_shard
        self._store_shard(self._mine(whole), param.requires_grad)

    def _mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `whole` (a tensor of the TP-local shape) on the shard dim."""
        return whole.narrow(self.layout.dim, self._chunk.start, len(self._chunk))

    def _store_shard(
        self, local: torch.Tensor, requires_grad: bool, keep: nn.Parameter | None = None
    ) -> None:
        """Make `local` (this rank's slice) the shard: copy it into a fresh padded shard,
        build the sharded parameter on it (as the object `keep`, if given, so optimizers
        and modules holding it see the new data), and size the unsharded buffers to match.
        A meta `local` stays on meta until `materialize`."""
        self.extension = None  # a new local shard: the unit looks for hooks again
        on_meta = local.is_meta
        self.padded_shard = zeroed_shard(
            local, self.layout.padded_shard_numel, self._shard_device, self._pin_memory
        )
        self.local = self.padded_shard[: self._local_shape.numel()].view(self._local_shape)
        if not on_meta:
            self.local.copy_(local)
        sharded = nn.Parameter(self._as_dtensor(self.local), requires_grad=requires_grad)
        if keep is not None:
            give_data(keep, sharded)
            sharded = keep
        self.sharded = sharded
        SHARDED_IDS.add(id(sharded))  # optimizers step on its local tensor
        self.local = local_of(sharded)  # a detached alias of the view: Parameter() detaches
        carry_hooks(local, self.local)
        self.param_dtype = self.mp_policy.param_dtype or local.dtype
        self.reduce_dtype = self.mp_policy.reduce_dtype or (
            local.dtype if REDUCE_IN_OWN_DTYPE else self.param_dtype
        )
        self.allocate_unsharded_buffer(local.device if on_meta else self._device)

    def move_shard_into(self, flat_piece: torch.Tensor) -> None:
        """Keep the padded shard in `flat_piece` (this parameter's part of its unit's flat
        shard, so the unit sends it without a copy), in the same parameter object."""
        flat_piece.copy_(self.padded_shard)
        self.padded_shard = flat_piece
        # Same dtype, device and spec: only the local tensor changes (see give_data).
        local, self.local = self.local, flat_piece[: self._local_shape.numel()].view(self._local_shape)
        carry_hooks(local, self.local)
        self.sharded._local_tensor = self.local  # type: ignore[attr-defined]

    def allocate_unsharded_buffer(self, device: torch.device) -> None:
        """Unsharded data of its own (allocated while unsharded: see unit/layout.py)."""
        buffer = torch.empty(
            self.layout.shard_size * self.layout.padded_shard_numel, dtype=self.param_dtype,
            device=device,
        )
        self.use_unsharded_buffer(buffer)
        buffer.untyped_storage().resize_(0)  # allocated while unsharded (MeshPart.lay_out)

    def use_unsharded_buffer(self, buffer: torch.Tensor) -> None:
        """Keep the unsharded data in `buffer` (flat, shard_size * padded_shard_numel, in
        param_dtype, allocated while views of it are taken; maybe part of a storage the
        unit shares between its parameters)."""
        self._unsharded_buffer = buffer
        # Note [version counter]: the all-gather writes through `.data`, an alias with its
        # own version counter. Writing through the buffer itself would bump the counter
        # that autograd checks on the unsharded parameter saved for backward, and the
        # re-gather before backward would then look like an illegal in-place edit.
        # Where the all-gather result lands (see ShardLayout.rank_rows; 2-D on dim 0).
        self.gather_target = self.layout.rank_rows(buffer.data)
        unsharded = buffer[: self.layout.numel].view(self.layout.shape)
        if self._tp is not None:
            unsharded = self._tp.as_dtensor(unsharded)
        self.unsharded = nn.Parameter(unsharded, requires_grad=self.sharded.requires_grad)

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        mesh, placements, shape, stride = self._spec
        # Not DTensor.from_local: it copies a local tensor onto the mesh's device type, and a
        # CPU-offloaded shard (and so its DTensor, whose device its `.grad` must match) has
        # to stay in CPU memory on an accelerator's mesh. torch's fully_shard builds it so too.
        spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)

    @property
    def shape(self) -> torch.Size:
        """The parameter's shape (a tensor-parallel one's global shape)."""
        return self._spec[2]

    @property
    def is_tensor_parallel(self) -> bool:
        return self._tp is not None

    @property
    def is_meta(self) -> bool:
        return self.padded_shard.is_meta

    def materialize(self, unsharded: torch.Tensor) -> None:
        """Keep this rank's slice of `unsharded` (an initialised meta parameter) as the
        shard, in the same parameter object (an optimizer built already keeps working)."""
        self._store_shard(self._mine(unsharded), self.sharded.requires_grad, keep=self.sharded)

    def shard_of(self, whole: torch.Tensor) -> DTensor:
        """This rank's slice of `whole` (a tensor of the parameter's shape), as a DTensor like ours."""
        local = self._tp.slice(whole.detach()) if self._tp is not None else whole.detach()
        return self._as_dtensor(self._mine(local))

    def adopt_registered(self, fqn_prefix: str = "") -> bool:
        """Make what the module holds our shard again, if it changed behind our back:
        `module.to_empty()` / `.to()` swap the sharded parameter's data, `load_state_dict(
        assign=True)` replaces it by a DTensor (which becomes the sharded parameter), an
        assignment by a whole tensor (whose values are copied into the sharded parameter,
        with a warning naming it, `fqn_prefix + fqn`); the unsharded form follows a parameter
        frozen or unfrozen since. Returns whether the shard was stored anew."""
        parameters, attr = self._home
        registered = parameters.get(attr)
        # As in every iteration: ours, sharded (its local tensor read directly).
        if registered is self.sharded and registered._local_tensor is self.local:  # type: ignore[attr-defined]
            if self.unsharded.requires_grad is not registered.requires_grad:
                self.unsharded.requires_grad_(registered.requires_grad)
            return False
        if registered is self.unsharded:
            return False
        if isinstance(registered, DTensor):
            if (registered.device_mesh, tuple(registered.placements), registered.shape) != (
                self._spec[0], tuple(self._spec[1]), self.shape
            ):
                raise ValueError(
                    f"fsdp_compose: parameter {self.fqn!r} was replaced by a DTensor of shape "
                    f"{tuple(registered.shape)} with {registered.placements} on "
                    f"{registered.device_mesh}; expected shape {tuple(self.shape)} with "
                    f"{self._spec[1]} on {self._spec[0]}. Assign a tensor of the original "
                    "shape (whole or sharded like the original)."
                )
            self._store_shard(local_of(registered), registered.requires_grad, keep=registered)
        elif isinstance(registered, torch.Tensor) and registered.shape == self.shape:
            # Into the sharded parameter the optimizer holds, so that it steps the new values.
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
        for module, attr in self.owners:
            module._parameters[attr] = self.sharded
        return True

    @property
    def unsharded_buffer(self) -> torch.Tensor:
        """The unsharded data, flat and padded; its storage is the unit's to allocate."""
        return self._unsharded_buffer

    def to_unsharded(self) -> None:
        """Register the unsharded parameter (its data must already be gathered)."""
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)  # frozen after annotation
        for module, name in self.owners:
            module._parameters[name] = self.unsharded

    def to_sharded(self) -> None:
        """Register the sharded parameter (the unit frees the unsharded storage)."""
        for module, name in self.owners:
            module._parameters[name] = self.sharded

    def registrations(self) -> list[Registration]:
        """Where the parameter is registered, with its forms as they are now: what the unit
        needs to swap all its parameters in one loop (see MeshPart.lay_out)."""
        return [
            Registration(module._parameters, name, self.sharded, self.unsharded)
            for module, name in self.owners
        ]

    def pop_unsharded_grad(self) -> torch.Tensor | None:
        """This backward's unsharded gradient as a plain tensor (a tensor-parallel one's
        local part, in the parameter's placements); clears it. See unit/grad_ledger.py."""
        grad = self.unsharded.grad
        if grad is None:
            return None
        self.unsharded.grad = None
        return grad if self._tp is None else self._tp.local(grad)  # type: ignore[arg-type]

    def run_grad_hooks(self) -> None:
        """Run the hooks a user registered on the sharded parameter with
        `register_post_accumulate_grad_hook` (e.g. an optimizer step in backward): autograd
        never calls them, since only the unsharded parameter is in the graph. Called once
        its reduced gradient joined the sharded `.grad`, as torch's fully_shard does."""
        hooks = self.sharded._post_accumulate_grad_hooks
        if hooks:
            for hook in tuple(hooks.values()):
                hook(self.sharded)

    def add_to_grad(self, padded_grad_shard: torch.Tensor) -> None:
        """Add this rank's reduced gradient shard (flat, padded) to the sharded `.grad`
        (a view of it when `.grad` was None and no cast is needed)."""
        local = padded_grad_shard.as_strided(self._local_shape, self._local_stride)  # its prefix
        shard = self.padded_shard
        if local.dtype != shard.dtype or local.device != shard.device:
            local = local.to(shard.device, shard.dtype)  # reduce_dtype, or offload to CPU
        if self.sharded.grad is None:
            # The parameter's own spec, without from_local's autograd function: this runs
            # for every parameter after every backward.
            spec = self.sharded._spec  # type: ignore[attr-defined]  # a Parameter of a DTensor
            self.sharded.grad = DTensor(local, spec, requires_grad=False)
        else:
            local_of(self.sharded.grad).add_(local)
