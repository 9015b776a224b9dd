"""replace_torch_fsdp(): for this process, torch's public FSDP2 names are fsdp_compose's, so
frameworks that call torch.distributed.fsdp.fully_shard (torchtitan, accelerate and the
transformers Trainer, Lightning) run on fsdp_compose without an edit.

The one module of the package that names torch's FSDP modules: it rebinds names in them,
by name, when called, and never imports or calls torch's implementation otherwise
(docs/design.md, "Frameworks"). FSDP1 (FullyShardedDataParallel) is left alone.
"""

from __future__ import annotations

import gc
import importlib
import sys
import warnings
from types import ModuleType, TracebackType

from ..comm.meshes import DataParallelMeshDims
from ..param.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .fsdp_module import FSDPModule, UnshardHandle
from .fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx

# Where torch binds its public FSDP2 names: the public package and its re-exports.
TORCH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed.fsdp._fully_shard",
)
# Ours for each of torch's names; a name a torch version lacks is left out there.
OURS: dict[str, object] = {
    "fully_shard": fully_shard,
    "FSDPModule": FSDPModule,
    "UnshardHandle": UnshardHandle,
    "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "OffloadPolicy": OffloadPolicy,
    "CPUOffloadPolicy": CPUOffloadPolicy,
    "register_fsdp_forward_method": register_fsdp_forward_method,
    "share_comm_ctx": share_comm_ctx,
    "DataParallelMeshDims": DataParallelMeshDims,
}


class TorchFSDPSwitch:
    """What replace_torch_fsdp() rebound; `restore()` (or leaving its `with` block) puts
    torch's names back."""

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

    def __enter__(self) -> TorchFSDPSwitch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()


def replace_torch_fsdp() -> TorchFSDPSwitch:
    """Rebind, for this process, torch's public FSDP2 names (fully_shard, FSDPModule,
    UnshardHandle, the policies, register_fsdp_forward_method, share_comm_ctx and, where
    torch has it, DataParallelMeshDims) to fsdp_compose's, in torch.distributed.fsdp and
    wherever torch re-exports them. Returns a handle whose `restore()` undoes it (also a
    context manager); on again while on, it changes nothing and its handle restores nothing.

    Refuses (RuntimeError, naming the modules) when torch's own fully_shard has already
    annotated a module in this process: the two runtimes cannot share a model. Warns
    (RuntimeWarning) naming the modules imported before it that bound torch's names, which
    keep torch's: `python -m fsdp_compose.run` switches before anything is imported.
    """
    modules = [m for m in map(_imported, TORCH_MODULES) if m is not None]
    torch_fsdp = modules[0]
    if getattr(torch_fsdp, "fully_shard", None) is fully_shard:
        return TorchFSDPSwitch([])
    originals = {name: getattr(torch_fsdp, name) for name in OURS if hasattr(torch_fsdp, name)}
    if annotated := _annotated_by(originals["FSDPModule"]):
        raise RuntimeError(
            f"replace_torch_fsdp: torch's fully_shard already annotated {annotated} in this "
            "process, and fsdp_compose cannot take over a model torch's runtime holds. Switch "
            "before building the model: python -m fsdp_compose.run your_script.py."
        )
    if early := _bound_early(originals):
        warnings.warn(
            f"replace_torch_fsdp: {early} imported torch's FSDP names before the switch and "
            "keep them (torch's fully_shard there). Start the program with python -m "
            "fsdp_compose.run (script or -m module) so that the switch comes first.",
            RuntimeWarning, stacklevel=2,
        )
    replaced = []
    for module in modules:
        for name, ours in OURS.items():
            if name in originals and hasattr(module, name):
                replaced.append((module, name, getattr(module, name)))
                setattr(module, name, ours)
    return TorchFSDPSwitch(replaced)


def _imported(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:  # a re-export this torch does not have
        return None


def _annotated_by(torch_fsdp_module: object) -> list[str]:
    """The classes of live modules torch's fully_shard annotated (a one-time scan)."""
    assert isinstance(torch_fsdp_module, type)
    # type(), not isinstance: some objects warn when their __class__ is read.
    found = {type(o).__name__ for o in gc.get_objects() if issubclass(type(o), torch_fsdp_module)}
    return sorted(found)


def _bound_early(originals: dict[str, object]) -> list[str]:
    """Modules outside torch and fsdp_compose holding one of torch's names as their own."""
    early = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None or name.split(".")[0] in ("torch", "fsdp_compose"):
            continue
        if any(namespace.get(n) is obj for n, obj in originals.items()):
            early.append(name)
    return sorted(early)
