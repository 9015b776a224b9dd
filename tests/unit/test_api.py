"""The public API's shape and the checks that need no process group."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_compose
from fsdp_compose import FSDPModule, MixedPrecisionPolicy, fully_shard
from fsdp_compose.comm.collectives import GradReduction, grad_reduction

AVG, SUM = ReduceOp.AVG, ReduceOp.SUM


def test_fully_shard_signature_matches_torch():
    ours = inspect.signature(fully_shard).parameters
    theirs = inspect.signature(torch_fully_shard).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, param in theirs.items():
        assert ours[name].kind == param.kind, name
        if name == "mp_policy":  # param_dtype_override_fn: torch 2.15's, ours on every torch
            ours_fields = dataclasses.asdict(ours[name].default)
            theirs_fields = dataclasses.asdict(param.default)
            assert set(ours_fields) - set(theirs_fields) <= {"param_dtype_override_fn"}
            assert theirs_fields == {k: v for k, v in ours_fields.items() if k in theirs_fields}
        elif name != "module":
            assert repr(ours[name].default) == repr(param.default), name
    # What we add comes after, keyword-only, off by default. dp_mesh_dims is ours on every
    # torch: an older torch's fully_shard lacks it, and then it counts among our additions.
    extras = {name: p for name, p in ours.items() if name not in theirs}
    added = ([] if "dp_mesh_dims" in theirs else ["dp_mesh_dims"]) + ["sync_module_states"]
    assert list(extras) == added
    assert all(p.kind is p.KEYWORD_ONLY and not p.default for p in extras.values())


def test_fsdp_module_has_every_public_method_of_torch():
    public = {n for n in dir(TorchFSDPModule) if not n.startswith("_")}
    missing = sorted(n for n in public if not hasattr(FSDPModule, n))
    assert not missing, missing


def test_public_names():
    assert sorted(fsdp_compose.__all__) == [
        "AllGatherCodec", "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule",
        "GradientReductionHandle", "Int8RowCodec", "MixedPrecisionPolicy", "OffloadPolicy",
        "Plan", "Setup", "StepTrace", "TorchFSDPSwitch", "UnmanagedParametersWarning",
        "UnshardHandle", "WrapPolicy", "checkpoint_blocks", "clip_grad_norm_",
        "fully_shard", "iter_full_state_dict", "load_checkpoint",
        "load_full_state_dict", "materialize", "plan", "register_fsdp_forward_method",
        "replace_torch_fsdp", "replicate", "save_checkpoint", "save_full_state_dict",
        "set_local_optimizer_step", "share_comm_ctx", "wrap",
    ]


def test_share_comm_ctx_is_torchs():
    from torch.distributed.fsdp import share_comm_ctx

    assert list(inspect.signature(fsdp_compose.share_comm_ctx).parameters) == list(
        inspect.signature(share_comm_ctx).parameters
    )


def test_policies_are_frozen():
    with pytest.raises(AttributeError):
        MixedPrecisionPolicy().param_dtype = torch.bfloat16  # type: ignore[misc]


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"fully_shard\(Linear\): no default process group"):
        fully_shard(torch.nn.Linear(2, 2))


def test_a_custom_factor_is_premul_sum_where_the_backend_has_it():
    """NCCL fuses the scaling into the reduce-scatter, as torch asks; gloo gets its math."""
    nccl = grad_reduction(4, 1, torch.float32, 8.0, False, premul_sum=True)
    assert nccl.pre_scale is None and nccl.post_divide is None
    assert isinstance(nccl.op, ReduceOp) and nccl.op == ReduceOp.PREMUL_SUM
    assert getattr(nccl.op, "factor", 0.125) == 0.125  # older torch's ReduceOp hides it
    assert nccl.scatter_options[1].reduceOp == ReduceOp.PREMUL_SUM
    gloo = grad_reduction(4, 1, torch.float32, 8.0, False, premul_sum=False)
    assert gloo[:4] == (0.125, SUM, SUM, None)
    # The backend's AVG where the factor is the group's size; fp16 and force_sum unchanged.
    assert grad_reduction(4, 1, torch.float32, 4.0, False, premul_sum=True).op == AVG
    forced = grad_reduction(4, 1, torch.float32, 8.0, True, premul_sum=True)
    assert forced[:4] == (None, SUM, SUM, 8.0)


@pytest.mark.parametrize(
    ("sizes", "dtype", "factor", "force_sum", "expected"),
    [
        ((4, 1), torch.float32, None, False, (None, AVG, AVG, None)),
        ((1, 1), torch.float32, None, False, (None, SUM, SUM, None)),
        ((2, 2), torch.float32, None, False, (None, AVG, AVG, None)),
        ((1, 4), torch.bfloat16, None, False, (None, AVG, AVG, None)),
        ((4, 1), torch.bfloat16, 4.0, False, (None, AVG, SUM, None)),
        ((4, 1), torch.float32, 1.0, False, (1.0, SUM, SUM, None)),
        ((4, 1), torch.float32, None, True, (None, SUM, SUM, 4.0)),
        ((2, 2), torch.float32, 8.0, True, (None, SUM, SUM, 8.0)),
        # float16: about sqrt(factor) before the sum, the rest after
        ((4, 1), torch.float16, None, False, (0.5, SUM, SUM, 2.0)),
        ((4, 2), torch.float16, None, False, (0.25, SUM, SUM, 2.0)),
        ((1, 1), torch.float16, None, False, (None, SUM, SUM, None)),
    ],
)
def test_grad_reduction(sizes, dtype, factor, force_sum, expected):
    reduction = grad_reduction(*sizes, dtype, factor, force_sum)
    assert reduction[:4] == GradReduction(*expected)[:4]
    for async_op, options in enumerate(reduction.scatter_options):
        assert options.reduceOp == reduction.op and options.asyncOp == bool(async_op)
