"""Fully sharded data parallel as a module annotation. Public: the names in __all__."""

from ._activation_checkpointing import checkpoint_blocks
from ._checkpoint import export_safetensors, load_checkpoint, save_checkpoint
from ._clip import clip_grad_norm_
from ._codec import AllGatherCodec, Int8RowCodec
from ._full_state_dict import load_full_state_dict, save_full_state_dict
from ._fsdp_module import FSDPModule, GradientReductionHandle, UnshardHandle
from ._fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx
from ._init import materialize
from ._meshes import DataParallelMeshDims
from ._planner import Plan, Setup, plan
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._replicate import replicate
from ._trace import StepTrace
from ._unmanaged import UnmanagedParametersWarning
from ._wrap import WrapPolicy, wrap

__all__ = [
    "AllGatherCodec",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "Int8RowCodec",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Plan",
    "Setup",
    "StepTrace",
    "UnmanagedParametersWarning",
    "UnshardHandle",
    "WrapPolicy",
    "checkpoint_blocks",
    "clip_grad_norm_",
    "export_safetensors",
    "fully_shard",
    "load_checkpoint",
    "load_full_state_dict",
    "materialize",
    "plan",
    "register_fsdp_forward_method",
    "replicate",
    "save_checkpoint",
    "save_full_state_dict",
    "share_comm_ctx",
    "wrap",
]
