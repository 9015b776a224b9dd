"""Train one model three ways on the same data and compare: single process on all ranks'
data (the reference), fsdp_compose on each rank's share, torch's fully_shard likewise."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

Shard = Callable[..., object]  # fully_shard or torch's, with the same signature
LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class ParityErrors(NamedTuple):
    vs_reference: float  # max |ours - single process| over parameters and steps
    vs_torch: float  # max |ours - torch fully_shard| over losses, parameters and grads


def per_block(model: nn.Module, shard: Shard, **kwargs: object) -> None:
    """One unit per entry of `model.layers` / `model.blocks`, then the root."""
    for block in getattr(model, "layers", None) or model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)


def torch_kwargs(kwargs: dict[str, object]) -> dict[str, object]:
    """The same options for torch's fully_shard, whose policies are its own classes."""
    policy = kwargs.get("mp_policy")
    if isinstance(policy, MixedPrecisionPolicy):
        fields = {f.name for f in dataclasses.fields(TorchMixedPrecisionPolicy)}
        settings = {k: v for k, v in dataclasses.asdict(policy).items() if k in fields}
        assert settings == dataclasses.asdict(policy) or policy.param_dtype_override_fn is None
        kwargs = {**kwargs, "mp_policy": TorchMixedPrecisionPolicy(**settings)}
    offload = kwargs.get("offload_policy")
    if isinstance(offload, CPUOffloadPolicy):
        kwargs = {**kwargs, "offload_policy": TorchCPUOffloadPolicy(**dataclasses.asdict(offload))}
    return kwargs


def make_mesh(shape: tuple[int, ...] | None = None) -> DeviceMesh:
    """A CPU mesh of `shape` (default: 1-D over all ranks); 2-D ones are (replicate, shard)."""
    shape = shape or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(shape) == 2 else None
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def three_models(
    make_model: Callable[[], nn.Module],
    mesh: DeviceMesh | None = None,
    wrap: Callable[[nn.Module, Shard], None] = per_block,
    shard_fns: tuple[Shard, Shard] = (fully_shard, torch_fully_shard),
    **shard_kwargs: object,
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The reference, ours and torch's, from the same initialisation, annotated by `wrap`
    with `shard_kwargs` (`wrap` may override them, the mesh included)."""
    mesh = mesh or make_mesh()
    torch.manual_seed(0)  # same init on every rank
    ref = make_model()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    ours_fn, theirs_fn = shard_fns
    wrap(ours, lambda m, **kw: ours_fn(m, **{"mesh": mesh, **shard_kwargs, **kw}))
    convert = torch_kwargs if theirs_fn is torch_fully_shard else dict
    wrap(theirs, lambda m, **kw: theirs_fn(m, **convert({"mesh": mesh, **shard_kwargs, **kw})))
    return ref, ours, theirs


def two_models(
    make_model: Callable[[], nn.Module],
    mesh: DeviceMesh | None = None,
    wrap: Callable[[nn.Module, Shard], None] = per_block,
    **shard_kwargs: object,
) -> tuple[nn.Module, nn.Module]:
    """The reference and ours (see three_models), for what torch's fully_shard cannot run
    or the test does not compare with it: torch's is then not built at all."""
    mesh = mesh or make_mesh()
    torch.manual_seed(0)  # same init on every rank
    ref = make_model()
    ours = copy.deepcopy(ref)
    wrap(ours, lambda m, **kw: fully_shard(m, **{"mesh": mesh, **shard_kwargs, **kw}))
    return ref, ours


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    wide = torch.complex128 if a.is_complex() else torch.float64
    return (a.to(wide) - b.to(wide)).abs().max().item()


def full(t: torch.Tensor) -> torch.Tensor:
    """`t` whole, on the CPU. A DTensor's local shard moves to the CPU first and is gathered
    over a CPU mesh of the same ranks: torch 2.11's functional collectives crash on CUDA
    tensors over gloo (ranks sharing a GPU), and CPU runs compare through the same code."""
    if not isinstance(t, DTensor):
        return t.detach().cpu()
    local = t.to_local().detach().cpu()
    on_cpu = DTensor.from_local(
        local, cpu_mesh(t.device_mesh), t.placements, shape=t.shape, stride=t.stride()
    )
    return on_cpu.full_tensor()


def cpu_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh` itself on the CPU, else a CPU mesh over the same ranks (made once)."""
    if mesh.device_type == "cpu":
        return mesh
    return _cpu_mesh(tuple(map(tuple, mesh.mesh.reshape(mesh.ndim, -1).tolist())),
                     tuple(mesh.mesh.shape), mesh.mesh_dim_names)


@functools.cache
def _cpu_mesh(
    ranks: tuple[tuple[int, ...], ...], shape: tuple[int, ...], names: tuple[str, ...] | None
) -> DeviceMesh:
    return DeviceMesh("cpu", torch.tensor(ranks).reshape(shape), mesh_dim_names=names)


def rank_share(batch: torch.Tensor) -> torch.Tensor:
    """This rank's share of a batch that every rank holds whole: its chunk of dim 0."""
    return batch.chunk(dist.get_world_size())[dist.get_rank()]


def backward(
    models: Sequence[nn.Module],
    batch: torch.Tensor,
    loss_fn: LossFn,
    share: Callable[[torch.Tensor], torch.Tensor] = rank_share,
) -> list[torch.Tensor]:
    """The reference (`models[0]`) computes `loss_fn` on the whole batch, every other model
    on this rank's `share` of it; then each loss's backward. Returns the losses."""
    ref, *sharded = models
    losses = [loss_fn(ref, batch), *(loss_fn(model, share(batch)) for model in sharded)]
    for loss in losses:
        loss.backward()
    return losses


def optimizer_step(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    for optim in optimizers:
        optim.step()
        optim.zero_grad()


def whole_pairs(
    model: nn.Module, other: nn.Module, grads: bool = False
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, `model`'s, `other`'s) per parameter, whole, or with `grads` per gradient: after
    asserting the same names in the same order and, for gradients, one on both or neither
    (a parameter that has none on both is left out)."""
    ours, theirs = dict(model.named_parameters()), dict(other.named_parameters())
    assert list(ours) == list(theirs), "parameter names changed"
    pairs = []
    for fqn, p in ours.items():
        a, b = (p.grad, theirs[fqn].grad) if grads else (p, theirs[fqn])
        assert (a is None) == (b is None), fqn
        if a is not None:
            a, b = full(a), full(b)
            assert a.shape == b.shape, (fqn, a.shape, b.shape)
            pairs.append((fqn, a, b))
    return pairs


def assert_close_to(
    model: nn.Module, ref: nn.Module, grads: bool = False, where: object = "", **tolerance: float
) -> float:
    """assert_close of every parameter of `model` (with `grads`, every gradient), whole, to
    `ref`'s of the same name (see `whole_pairs`); returns the largest difference."""
    kind = "grad" if grads else "param"
    worst = 0.0
    for fqn, a, b in whole_pairs(model, ref, grads):
        torch.testing.assert_close(
            a, b, msg=lambda m, fqn=fqn: f"{kind} {fqn} {where}: {m}", **tolerance
        )
        worst = max(worst, max_diff(a, b))
    return worst


def max_diff_to(model: nn.Module, other: nn.Module, grads: bool = False) -> float:
    """The largest difference between the parameters (with `grads`, the gradients) of two
    models, whole (see `whole_pairs`); 0.0 where they are equal."""
    return max((max_diff(a, b) for _, a, b in whole_pairs(model, other, grads)), default=0.0)


def spmd_diffs(
    ours: nn.Module, theirs: nn.Module, ref: nn.Module, grads: bool = False
) -> tuple[float, float]:
    """The largest difference of `ours`' DTensor parameters (with `grads`, gradients), whole,
    to `theirs`' and to the plain `ref`'s, parameter by parameter in order."""
    vs_torch = vs_ref = 0.0
    for p, q, r in zip(ours.parameters(), theirs.parameters(), ref.parameters()):
        a, b, c = (p.grad, q.grad, r.grad) if grads else (p, q, r)
        vs_torch = max(vs_torch, max_diff(full(a), full(b)))
        vs_ref = max(vs_ref, max_diff(full(a), full(c)))
    return vs_torch, vs_ref


def train_and_compare(
    make_model: Callable[[], nn.Module],
    loss_fn: LossFn,
    make_batch: Callable[[int, int], torch.Tensor],
    steps: int = 3,
    wrap: Callable[[nn.Module, Shard], None] = per_block,
    reference_tolerance: dict[str, float] | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    shard_fns: tuple[Shard, Shard] = (fully_shard, torch_fully_shard),
    torch_differs: str | None = None,
    **shard_kwargs: object,
) -> ParityErrors:
    """AdamW steps three ways; assert equal names, losses, parameters and gradients: close
    to the single-process reference, and exactly equal (0.0) to torch's fully_shard.

    `reference_tolerance`: assert_close's rtol/atol against the float32 single-process
    reference (its defaults when None), for runs that compute in lower precision.
    `mesh_shape`: the mesh passed to every call (default: 1-D over all ranks); `wrap` may
    pass another. `shard_fns`: ours and torch's annotation functions. `torch_differs`: why
    this run may differ from torch's (torch lacks the feature or differs on purpose); the
    difference is then only returned, for the caller to bound.
    """
    tolerance = reference_tolerance or {}
    world = dist.get_world_size()
    models = three_models(make_model, make_mesh(mesh_shape), wrap, shard_fns, **shard_kwargs)
    ref, ours, theirs = models
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    vs_ref = vs_torch = 0.0
    for step in range(steps):
        # The reference sees all the data, each rank's models their share.
        ref_loss, our_loss, their_loss = backward(models, make_batch(step, 2 * world), loss_fn)
        global_loss = our_loss.detach().clone()
        dist.all_reduce(global_loss)
        torch.testing.assert_close(
            global_loss / world, ref_loss.detach().to(global_loss.dtype),
            msg=lambda m, step=step: f"loss {step}: {m}", **tolerance,
        )
        vs_torch = max(vs_torch, max_diff(our_loss, their_loss))
        assert_close_to(ours, ref, grads=True, where=step, **tolerance)
        vs_torch = max(vs_torch, max_diff_to(ours, theirs, grads=True))
        optimizer_step(optims)
        vs_ref = max(vs_ref, assert_close_to(ours, ref, where=step, **tolerance))
        vs_torch = max(vs_torch, max_diff_to(ours, theirs))
    assert torch_differs is not None or vs_torch == 0.0, (
        f"differs from torch's fully_shard by {vs_torch} (losses, gradients, parameters); "
        "pass torch_differs='why' where that is by design"
    )
    return ParityErrors(vs_ref, vs_torch)
