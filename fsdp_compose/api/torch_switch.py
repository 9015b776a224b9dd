"""replace_torch_fsdp(): for this process, torch's public FSDP2 names are fsdp_compose's, so
frameworks that call torch's fully_shard (torchtitan, accelerate, Lightning) run on ours.
The one module naming torch's FSDP modules, only when called (docs/design.md, "Frameworks")."""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import sys
import warnings
from types import ModuleType

from ..comm.meshes import DataParallelMeshDims
from ..param.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .fsdp_module import FSDPModule, GradientReductionHandle, UnshardHandle
from .fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx

# Where torch binds its public FSDP2 names: the public package and its re-exports.
TORCH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed.fsdp._fully_shard",
)
# Ours for each of torch's names; a name a torch version lacks is left out there.
OURS: dict[str, object] = {f.__name__: f for f in (
    fully_shard, FSDPModule, UnshardHandle, MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy,
    share_comm_ctx, register_fsdp_forward_method, DataParallelMeshDims, GradientReductionHandle,
)}


class TorchFSDPSwitch(contextlib.AbstractContextManager["TorchFSDPSwitch"]):
    """What replace_torch_fsdp() rebound; `restore()`, or leaving `with`, puts torch's back."""

    def __init__(self, replaced: list[tuple[ModuleType, str, object]]) -> None:
        self._replaced = replaced

    @property
    def names(self) -> list[str]:
        """`module.name` for every name rebound (empty: the switch was already on)."""
        return [f"{module.__name__}.{name}" for module, name, _ in self._replaced]

    def restore(self) -> None:
        """torch's names back where they were; a second call does nothing."""
        for module, name, original in reversed(self._replaced):
            setattr(module, name, original)
        self._replaced = []

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


def replace_torch_fsdp() -> TorchFSDPSwitch:
    """Rebind torch's public FSDP2 names (OURS) in torch.distributed.fsdp and its re-exports
    to ours until the handle's `restore()`; a no-op while on. Refuses once torch's fully_shard
    annotated a module; warns about modules that bound torch's first (see fsdp_compose.run)."""
    # find_spec: None for a re-export this torch does not have.
    modules = [importlib.import_module(n) for n in TORCH_MODULES if importlib.util.find_spec(n)]
    torch_fsdp = modules[0]
    if getattr(torch_fsdp, "fully_shard", None) is fully_shard:
        return TorchFSDPSwitch([])
    originals = {name: getattr(torch_fsdp, name) for name in OURS if hasattr(torch_fsdp, name)}
    theirs = originals["FSDPModule"]
    # type(), not isinstance: some objects warn when their __class__ is read.
    if annotated := sorted({type(o).__name__ for o in gc.get_objects()
                            if issubclass(type(o), theirs)}):
        raise RuntimeError(
            f"replace_torch_fsdp: torch's fully_shard already annotated {annotated} in this "
            "process, and fsdp_compose cannot take over a model torch's runtime holds. Switch "
            "before building the model: python -m fsdp_compose.run your_script.py.")
    theirs_ids = {id(obj) for obj in originals.values()}
    # Modules other than torch's FSDP2 ones and ours holding torch's objects, by any name.
    if early := sorted(
        f"{name}.{attr}" for name, module in list(sys.modules.items())
        if not name.startswith(TORCH_MODULES) and name.split(".")[0] != "fsdp_compose"
        for attr, value in list(getattr(module, "__dict__", {}).items()) if id(value) in theirs_ids
    ):
        warnings.warn(
            f"replace_torch_fsdp: {early} were bound to torch's FSDP2 objects before the switch "
            "and keep them (torch's fully_shard there). Start the program with python -m "
            "fsdp_compose.run (script or -m module) so that the switch comes first.",
            RuntimeWarning, stacklevel=2)
    replaced = [(m, n, getattr(m, n)) for m in modules for n in originals if hasattr(m, n)]
    for module, name, _ in replaced:
        setattr(module, name, OURS[name])
    return TorchFSDPSwitch(replaced)

