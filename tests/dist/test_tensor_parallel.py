"""2-D parallelism: tensor parallelism inside (parallelize_module on mesh['tp']), fully_shard
across (mesh['dp']). Parity with single-process training and with torch's fully_shard at
W = 4 (dp 2 x tp 2), for an MLP and an attention block; state dicts and clipping on the
resulting 2-D parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_compose import clip_grad_norm_, fully_shard
from tests.dist.parity import (
    assert_close_to,
    backward,
    full,
    max_diff,
    max_diff_to,
    optimizer_step,
)
from tests.models import mse_loss


class Attention(nn.Module):
    """Self-attention whose heads split across tensor-parallel ranks."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(x)
        q, k, v = (proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))  # -1: this rank's heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TPModel(nn.Module):
    def __init__(self, dim: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Attention(dim, head_dim), MLP(dim)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


PLAN = {
    "blocks.0.q": ColwiseParallel(), "blocks.0.k": ColwiseParallel(),
    "blocks.0.v": ColwiseParallel(), "blocks.0.o": RowwiseParallel(),
    "blocks.1.up": ColwiseParallel(), "blocks.1.down": RowwiseParallel(),
}


def two_d(model: nn.Module, mesh, shard, **kwargs) -> nn.Module:
    parallelize_module(model, mesh["tp"], PLAN)
    for block in model.blocks:
        shard(block, mesh=mesh["dp"], **kwargs)
    shard(model, mesh=mesh["dp"], **kwargs)
    return model


def shard_dim_1(param: nn.Parameter) -> Shard | None:
    """Matrices on dim 1 of their TP-local tensor (where row-wise TP shards too)."""
    return Shard(1) if param.ndim == 2 else None


def check_tensor_parallel_parity(steps: int, placement_fn=None) -> tuple[float, list]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(0)
    ref = TPModel()
    ours = two_d(copy.deepcopy(ref), mesh, fully_shard, shard_placement_fn=placement_fn)
    theirs = two_d(copy.deepcopy(ref), mesh, torch_fully_shard, shard_placement_fn=placement_fn)
    placements = [
        (fqn, p.placements, q.placements)
        for (fqn, p), q in zip(ours.named_parameters(), theirs.parameters())
    ]
    models = (ref, ours, theirs)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    vs_torch = 0.0
    for step in range(steps):
        x = torch.randn(4 * dp_size, 5, 16, generator=torch.Generator().manual_seed(step))
        # The tp ranks of one dp rank share its data.
        backward(models, x, mse_loss, share=lambda batch: batch.chunk(dp_size)[dp_rank])
        assert_close_to(ours, ref, grads=True, where=step)
        vs_torch = max(vs_torch, max_diff_to(ours, theirs, grads=True))
        optimizer_step(optims)
        assert_close_to(ours, ref, where=step)
        vs_torch = max(vs_torch, max_diff_to(ours, theirs))
    return vs_torch, placements


@pytest.mark.parametrize("placement_fn", [None, shard_dim_1], ids=["dim 0", "dim 1"])
def test_tensor_parallel_trains_like_single_process_and_torch(ranks, placement_fn):
    results = ranks.run(
        check_tensor_parallel_parity, world_size=4, steps=3, placement_fn=placement_fn
    )
    for vs_torch, placements in results:
        assert vs_torch == 0.0
        for fqn, ours, theirs in placements:  # _StridedShard where TP shards the same dim
            assert ours == theirs, (fqn, ours, theirs)
        strided = {fqn for fqn, ours, _ in placements if type(ours[0]).__name__ == "_StridedShard"}
        # Column-wise weights are TP-sharded on dim 0, row-wise ones on dim 1.
        expected = {"blocks.0.q.weight", "blocks.0.k.weight", "blocks.0.v.weight",
                    "blocks.1.up.weight", "blocks.1.up.bias"}
        if placement_fn is not None:  # biases stay on dim 0
            expected = {"blocks.0.o.weight", "blocks.1.down.weight", "blocks.1.up.bias"}
        assert strided == expected, strided


def check_state_dict_and_clipping_on_2d_params() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = TPModel()
    model = two_d(copy.deepcopy(ref), mesh, fully_shard)
    up = model.blocks[1].up.weight
    assert isinstance(up, DTensor) and up.device_mesh.mesh_dim_names == ("dp", "tp")
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(state[key].full_tensor(), value), key

    torch.manual_seed(1)
    other = TPModel()  # whole tensors of another model load into the 2-D shards
    model.load_state_dict(other.state_dict())
    for key, value in other.state_dict().items():
        assert torch.equal(model.state_dict()[key].full_tensor(), value), key

    x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(0))
    dp_rank = mesh["dp"].get_local_rank()
    backward((other, model), x, mse_loss, share=lambda batch: batch.chunk(2)[dp_rank])
    ours = clip_grad_norm_(model.parameters(), max_norm=0.1)
    theirs = torch.nn.utils.clip_grad_norm_(other.parameters(), max_norm=0.1)
    torch.testing.assert_close(ours, theirs)
    assert_close_to(model, other, grads=True)
    assert dist.get_world_size() == 4


def test_state_dict_and_clipping_on_2d_params(ranks):
    ranks.run(check_state_dict_and_clipping_on_2d_params, world_size=4)


class SPAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SPBlock(nn.Module):
    """Norms outside the parallel modules, so they can run sequence parallel."""

    def __init__(self, dim: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SPAttention(dim, head_dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


def sequence_parallel_plan(blocks: int) -> dict:
    """Norms and the residual stream sharded on the sequence; attention and MLP gather it."""
    gather_sequence = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    plan = {}
    for i in range(blocks):
        plan.update({
            f"blocks.{i}.attn_norm": SequenceParallel(), f"blocks.{i}.ffn_norm": SequenceParallel(),
            f"blocks.{i}.attn": gather_sequence, f"blocks.{i}.ffn": gather_sequence,
            f"blocks.{i}.attn.q": ColwiseParallel(), f"blocks.{i}.attn.k": ColwiseParallel(),
            f"blocks.{i}.attn.v": ColwiseParallel(),
            f"blocks.{i}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.ffn.0": ColwiseParallel(),
            f"blocks.{i}.ffn.2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def check_sequence_parallel() -> float:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(0)
    ref = nn.Module()
    ref.blocks = nn.ModuleList([SPBlock(), SPBlock()])
    models = [ref, copy.deepcopy(ref), copy.deepcopy(ref)]
    for model, shard in zip(models[1:], (fully_shard, torch_fully_shard)):
        parallelize_module(model, mesh["tp"], sequence_parallel_plan(2))
        for block in model.blocks:
            shard(block, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])

    def run(model: nn.Module, x: torch.Tensor) -> None:
        for block in model.blocks:
            x = block(x)
        x.pow(2).sum().backward()

    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))
    run(ref, x)
    local = x.chunk(2)[dp_rank].chunk(2, dim=1)[tp_rank]  # dp: batch; tp: sequence
    for model in models[1:]:
        run(model, local)
    grads = [{fqn: full(p.grad) for fqn, p in m.named_parameters()} for m in models]
    for fqn, grad in grads[1].items():
        # A sum loss: the dp average halves it; the tp ranks' sums add up in TP's backward.
        torch.testing.assert_close(grad * 2, grads[0][fqn], msg=fqn)
    return max(max_diff(grad, grads[2][fqn]) for fqn, grad in grads[1].items())


def test_sequence_parallel_grads_match_single_process_and_torch(ranks):
    assert ranks.run(check_sequence_parallel, world_size=4) == [0.0] * 4
