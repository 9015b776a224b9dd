"""Misuse fails before any collective with an error that names the module and parameter."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from tests.dist.counting import CollectiveCounter
from tests.models import MLP, Transformer, feature_batch


def _raises(error: type[Exception], match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


class WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.temperature = nn.Parameter(torch.tensor(1.0))


def check_misuse_errors() -> None:
    model = MLP()
    fully_shard(model.layers[0])
    _raises(ValueError, r"fully_shard\(FSDPLinear\): this module is already annotated",
            fully_shard, model.layers[0])

    parent_first = MLP()
    fully_shard(parent_first)
    _raises(ValueError, r"parameter 'weight' is already sharded by fully_shard on an "
            r"enclosing module\. Annotate bottom-up", fully_shard, parent_first.layers[1])

    _raises(TypeError, "expects an nn.Module or a list of them, got Tensor",
            fully_shard, torch.ones(2))
    _raises(ValueError, "non-empty list", fully_shard, [])
    _raises(TypeError, "mesh must be a DeviceMesh, got str", fully_shard, MLP(), mesh="cpu")
    _raises(ValueError, "the mesh has 3 dimensions; pass a 1-D mesh", fully_shard, MLP(),
            mesh=init_device_mesh("cpu", (1, 1, dist.get_world_size())))
    _raises(TypeError, "reshard_after_forward must be a bool, None or an int group size, "
            "got str 'yes'", fully_shard, MLP(), reshard_after_forward="yes")
    _raises(ValueError, r"fully_shard\(MLP\): reshard_after_forward=3 must divide the mesh's "
            "shard size 2", fully_shard, MLP(), reshard_after_forward=3)
    annotated = fully_shard(MLP())
    _raises(ValueError, r"FSDPMLP.set_reshard_after_forward: reshard_after_forward=0 must divide",
            annotated.set_reshard_after_forward, 0)
    _raises(ValueError, r"MixedPrecisionPolicy.param_dtype=torch.int8 is not a floating-point",
            fully_shard, MLP(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
    _raises(TypeError, r"mp_policy must be a MixedPrecisionPolicy \(fsdp_compose's or torch's\)",
            fully_shard, MLP(), mp_policy={"param_dtype": torch.bfloat16})
    # torch's policies are taken field for field (code that imported them before the switch).
    taken = fully_shard(MLP(), mp_policy=TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert taken.layers[0].weight.dtype == torch.float32
    taken(feature_batch(0, 2)).sum().backward()
    assert {p.grad.dtype for p in taken.parameters()} == {torch.float32}
    with torch.device("meta"):
        on_meta = MLP()
    fully_shard(on_meta)
    _raises(RuntimeError, r"unit <root FSDPMLP> on rank 0: parameters still on the meta device: "
            r"\[layers\.0\.weight, .*fsdp_compose\.materialize\(model\)", on_meta, torch.ones(1, 8))

    tied = Transformer(tie_weights=True)
    fully_shard(tied.tok_emb, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    _raises(ValueError, r"fully_shard\(FSDPTransformer|fully_shard\(Transformer\): parameter "
            r"'head\.weight' is tied to 'weight' of unit Embedding, which gathers it on .* in "
            r"torch\.bfloat16; this unit would use .* and torch\.float32", fully_shard, tied)

    tensor_parallel = MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tensor_parallel.layers[0].weight = nn.Parameter(
        distribute_tensor(tensor_parallel.layers[0].weight.detach(), mesh, [Replicate()])
    )
    _raises(ValueError, r"parameter 'layers\.0\.weight' is a DTensor on mesh .* which is not a "
            r"tensor-parallel part of the same device mesh .* pass mesh=mesh\['dp'\]",
            fully_shard, tensor_parallel, mesh=mesh)

    as_list = [nn.Linear(3, 3), nn.Linear(3, 3)]
    fully_shard(as_list)
    _raises(RuntimeError, r"fully_shard\(\[FSDPLinear, FSDPLinear\]\) ran forward before any "
            "enclosing unit", as_list[0], torch.ones(1, 3))


def test_misuse_raises_clear_errors(ranks):
    ranks.run(check_misuse_errors, world_size=2)


def check_failed_call_leaves_module_untouched() -> None:
    model = WithScalar()
    before = list(model.parameters())
    _raises(ValueError, r"fully_shard\(WithScalar\): parameter 'temperature' is a scalar",
            fully_shard, model)
    assert type(model) is WithScalar and list(model.parameters()) == before
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    fully_shard(model, ignored_params={model.temperature})  # the fix the message suggests
    assert isinstance(model.linear.weight, DTensor) and type(model.temperature) is nn.Parameter


def test_failed_call_leaves_module_untouched(ranks):
    ranks.run(check_failed_call_leaves_module_untouched, world_size=2)


def check_ranks_with_different_models_fail_alike() -> None:
    # Rank 1 built a wider second layer: every rank raises the same error at the first
    # forward, before any all-gather could hang or fail on mismatched sizes.
    dims = (8, 7, 5, 3, 1) if dist.get_rank() == 0 else (8, 9, 5, 3, 1)
    model = MLP(dims)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    _raises(RuntimeError, r"ranks 0 and 1 built different models: unit layers\.0 has parameters "
            r"\['weight \(7, 8\) torch\.float32', 'bias \(7,\) torch\.float32'\] on rank 0 and "
            r"\['weight \(9, 8\) torch\.float32', 'bias \(9,\) torch\.float32'\] on rank 1 "
            r"\(5 and 5 units in all\)\. Build and annotate the model identically",
            model, torch.ones(1, 8))

    # Rank 1 built one layer fewer: it lacks a unit.
    model = MLP((8, 7, 5, 3, 1) if dist.get_rank() == 0 else (8, 7, 5, 1))
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    _raises(RuntimeError, r"ranks 0 and 1 built different models: rank 1 has no unit layers\.3, "
            r"which rank 0 has \(5 and 4 units in all\)", model, torch.ones(1, 8))

    # Only rank 1 left its model on the meta device: rank 1's message, on both ranks.
    device = "meta" if dist.get_rank() == 1 else "cpu"
    with torch.device(device):
        model = MLP()
    fully_shard(model)
    _raises(RuntimeError, r"unit <root FSDPMLP> on rank 1: parameters still on the meta device",
            model, torch.ones(1, 8))


def test_ranks_with_different_models_fail_alike(ranks):
    ranks.run(check_ranks_with_different_models_fail_alike, world_size=2)


def check_optimizer_built_before_fully_shard_is_refused() -> None:
    model = MLP()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model(torch.ones(2, 8)).sum().backward()
    _raises(RuntimeError, r"SGD holds parameter 'weight' of Linear as it was before fully_shard"
            r".*Build the optimizer after fully_shard", early.step)
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    late.step()  # the fix: built after fully_shard


def test_optimizer_built_before_fully_shard_is_refused(ranks):
    ranks.run(check_optimizer_built_before_fully_shard_is_refused, world_size=2)


def check_misuse_on_one_rank_does_not_communicate() -> int:
    """Argument checks raise before any collective: a rank alone with a mistake raises at
    once, instead of waiting in a collective the others never enter."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if dist.get_rank() != 0:
        return 0
    with CollectiveCounter() as comms:
        _raises(ValueError, "is a scalar", fully_shard, WithScalar(), mesh=mesh)
        _raises(ValueError, "must divide", fully_shard, MLP(), mesh=mesh, reshard_after_forward=3)
        _raises(ValueError, "not a floating-point", fully_shard, MLP(), mesh=mesh,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
    return sum(comms.counts.values())


def test_misuse_on_one_rank_does_not_communicate(ranks):
    assert ranks.run(check_misuse_on_one_rank_does_not_communicate, world_size=2) == [0, 0]



def check_ranks_that_built_other_values_are_warned(sync: bool) -> list[str]:
    """Weights loaded on rank 0 only: every rank warns at the first forward, naming the first
    parameter; sync_module_states=True, or equal values, warns of nothing."""
    torch.manual_seed(0)
    model = MLP()
    if dist.get_rank() == 0:
        with torch.no_grad():
            model.layers[1].weight.add_(1.0)  # "pretrained" on rank 0 only
    for layer in model.layers:
        fully_shard(layer, sync_module_states=sync)
    fully_shard(model, sync_module_states=sync)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.ones(2, 8)).sum().backward()
        model(torch.ones(2, 8)).sum().backward()  # checked once
    return [str(w.message) for w in caught if "fsdp_compose" in str(w.message)]


@pytest.mark.parametrize("sync", [False, True])
def test_ranks_that_built_other_values_are_warned(ranks, sync):
    warned = ranks.run(check_ranks_that_built_other_values_are_warned, sync=sync)
    if sync:
        assert warned == [[], []]
    else:
        assert warned[0] == warned[1] and len(warned[0]) == 1, warned
        assert "ranks 0 and 1 built parameter 'weight' (unit layers.1) with different values" \
            in warned[0][0] and "sync_module_states=True" in warned[0][0]


def check_a_shard_dimension_of_one_is_warned() -> list[str]:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(MLP(), mesh=mesh)
        fully_shard(MLP(), mesh=mesh["dp"])  # the fix: no warning
    return [str(w.message) for w in caught]


def test_a_shard_dimension_of_one_is_warned_naming_the_mesh(ranks):
    for warned in ranks.run(check_a_shard_dimension_of_one_is_warned):
        assert len(warned) == 1 and "shard dimension 'tp' has size 1 (shape (2, 1), dims " \
            "('dp', 'tp'))" in warned[0] and "mesh['dp']" in warned[0], warned
