"""Fully sharded data parallel as a module annotation. Public: the names in __all__."""

from .api.activation_checkpointing import checkpoint_blocks
from .api.fsdp_module import FSDPModule, GradientReductionHandle, UnshardHandle
from .api.fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx
from .api.init import materialize
from .api.replicate import replicate
from .api.torch_switch import TorchFSDPSwitch, replace_torch_fsdp
from .api.wrap import WrapPolicy, wrap
from .comm.meshes import DataParallelMeshDims
from .io.checkpoint import load_checkpoint, save_checkpoint
from .io.full_state_dict import load_full_state_dict, save_full_state_dict
from .io.whole_weights import iter_full_state_dict
from .param.codec import AllGatherCodec, Int8RowCodec
from .param.local_step import set_local_optimizer_step
from .param.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .schedule.unmanaged import UnmanagedParametersWarning
from .tools.clip import clip_grad_norm_
from .tools.planner import Plan, Setup, plan
from .tools.trace import StepTrace

__all__ = [
    "AllGatherCodec", "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule",
    "GradientReductionHandle", "Int8RowCodec", "MixedPrecisionPolicy", "OffloadPolicy", "Plan",
    "Setup", "StepTrace", "TorchFSDPSwitch", "UnmanagedParametersWarning", "UnshardHandle",
    "WrapPolicy", "checkpoint_blocks", "clip_grad_norm_", "fully_shard",
    "iter_full_state_dict", "load_checkpoint", "load_full_state_dict", "materialize", "plan",
    "register_fsdp_forward_method", "replace_torch_fsdp", "replicate", "save_checkpoint",
    "save_full_state_dict", "set_local_optimizer_step", "share_comm_ctx", "wrap",
]
