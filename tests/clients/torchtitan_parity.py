"""torchtitan's own trainers (the MoE debug models, and the dense llama3 debug model) with
fsdp_compose's fully_shard in place of torch's, compared step by step with FSDP2 (torch's
fully_shard), on CPU with gloo.

Not a pytest module (it needs torchtitan, which the project does not depend on): see
CONTRIBUTING.md, "Checking real clients: torchtitan", for the venv it runs in.

Two roles:

* worker, under torchrun: runs torchtitan's real Trainer (torchtitan.trainer.Trainer, as
  torchtitan.train.main builds it) for one model / SPMD backend / expert-parallel degree with
  torch's fully_shard (--impl torch) or fsdp_compose's (--impl compose, or --impl launcher
  under `python -m fsdp_compose.run`), and writes the loss, max loss and grad norm of every
  step, a checksum of every parameter (sum, abs sum and sha256 of its full tensor) and
  whose fully_shard ran (the FSDPModule class in the MRO of every annotated module, and
  where torchtitan's FSDP names come from) to --out (JSON, rank 0)::

    torchrun --standalone --nproc_per_node 2 tests/clients/torchtitan_parity.py \
        --model deepseek_v3 --backend full_dtensor --ep 1 --impl compose --out /tmp/c.json
    torchrun --standalone --nproc_per_node 2 -m fsdp_compose.run \
        tests/clients/torchtitan_parity.py \
        --model deepseek_v3 --backend full_dtensor --ep 1 --impl launcher --out /tmp/l.json

* driver, plain python: runs the worker with torch's fully_shard and then with each
  implementation named by --impl (compose by default; torch is always the reference) for
  each requested config, and prints one table row per config and implementation (add
  --keep-going to go on past a failure)::

    python tests/clients/torchtitan_parity.py --model deepseek_v3 \
        --backend partial_dtensor full_dtensor spmd_types --world 2 4 --ep 1 2
    python tests/clients/torchtitan_parity.py --impl compose launcher --world 2

What is changed in torchtitan, alike for both implementations: CPU stands in for the
accelerator (torchtitan picks "cuda" when torch has none); FlexAttention runs as plain
differentiable ops (flex_attention has no CPU backward) and create_block_mask uncompiled
(torchtitan compiles both); triton is a stub while torchtitan is imported (its kernels are
defined, never run); torch.distributed.set_timeout, which torchtitan 0.3.0 calls and torch
2.13 lacks, is c10d's _set_pg_timeout; every FSDP module also gets
set_force_sum_reduction_for_comms(True) after torchtitan's gradient_divide_factor=1.0
(torch's fully_shard would reduce-scatter with PREMUL_SUM, which gloo has not;
--no-force-sum leaves it out); a synthetic tokenizer and dataset replace the HF ones
(nothing is downloaded): every rank draws its batch from a generator seeded by (seed,
step, data-parallel rank). The model, its parallelize function, apply_fsdp_to_decoder,
activation checkpointing, the chunked loss, optimizer, LR schedule, gradient clipping and
the training loop are torchtitan's own. Only the sequence length (64), local batch size
(2) and step count (5) are made small.

--impl compose rebinds every name torchtitan took from torch.distributed.fsdp (and the
FSDPModule of torch.distributed._composable.fsdp, which torchtitan's chunked loss imports
inside a call) to fsdp_compose's: fully_shard, FSDPModule, MixedPrecisionPolicy and
CPUOffloadPolicy; with --swap-mesh-dims DataParallelMeshDims too (fsdp_compose takes
torch's as it is, and torchtitan hands it to a torch helper as well).

--impl launcher rebinds nothing itself: the driver starts it as `torchrun ... -m
fsdp_compose.run tests/clients/torchtitan_parity.py --impl launcher ...`, the way a user
starts `-m torchtitan.train`, so fsdp_compose gets in only through the launcher's
replace_torch_fsdp(), which rebinds torch's public FSDP2 names in torch.distributed.fsdp
and its re-exports before this script (and so torchtitan) is imported. The worker keeps only
the changes above, which apply to all implementations alike. It refuses to start unless
torch.distributed.fsdp.fully_shard is already fsdp_compose's (the torch and compose
workers refuse unless it is still torch's). The switch also rebinds DataParallelMeshDims
wherever torch has it (torch 2.13 has), so torchtitan then holds fsdp_compose's: launcher
mode always behaves like compose with --swap-mesh-dims as to that name (the flag is
implied there: the driver does not forward it, a launcher worker refuses it, and the
driver checks which class torchtitan held). It swaps UnshardHandle, OffloadPolicy,
register_fsdp_forward_method and share_comm_ctx as well, which compose leaves alone
(torchtitan 0.3.0 does not use them).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from typing import Any

MODELS = {
    # name: (config_registry module, config function)
    "deepseek_v3": ("torchtitan.models.deepseek_v3.config_registry", "deepseek_v3_debugmodel"),
    "qwen3_moe": ("torchtitan.models.qwen3.config_registry", "qwen3_moe_debug"),
    "llama3": ("torchtitan.models.llama3.config_registry", "llama3_debugmodel"),
}
DENSE = ("llama3",)  # no experts: run with --ep 1 only
BACKENDS = ("partial_dtensor", "full_dtensor", "spmd_types")
# torch: torch's fully_shard; compose: fsdp_compose's, rebound by this script in torchtitan's
# modules; launcher: fsdp_compose's through `python -m fsdp_compose.run` only
IMPLS = ("torch", "compose", "launcher")
SWAPPED = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")
# fsdp_compose takes torch's DataParallelMeshDims as it is; swapping it too (--swap-mesh-dims)
# also hands fsdp_compose's to the torch helper torchtitan calls for expert parallelism
# (torch.distributed.fsdp._fully_shard._fsdp_init._get_mesh_info).
MESH_DIMS = "DataParallelMeshDims"


# ----------------------------------------------------------------------------- worker


def _triton_stub() -> dict[str, types.ModuleType]:
    """Modules standing in for triton while torchtitan imports: its kernels are defined
    (decorated, annotated with tl.* types) but never run on CPU."""

    class _Any:
        def __getattr__(self, name: str) -> _Any:
            return self

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]  # a bare decorator
            return self

        def __getitem__(self, key: Any) -> _Any:
            return self

    class _Module(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any()

    def jit(fn: Any = None, **kwargs: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    triton = _Module("triton")
    triton.jit = jit  # type: ignore[attr-defined]
    triton.autotune = lambda *a, **k: (lambda f: f)  # type: ignore[attr-defined]
    triton.heuristics = lambda *a, **k: (lambda f: f)  # type: ignore[attr-defined]
    triton.Config = _Any()  # type: ignore[attr-defined]
    language = _Module("triton.language")
    triton.language = language  # type: ignore[attr-defined]
    return {"triton": triton, "triton.language": language}


class _CpuDevice:
    """torch.cpu with the accelerator calls torchtitan makes (memory stats, names)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    def device_count(self) -> int:
        return 1

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        page = os.sysconf("SC_PAGE_SIZE")
        return types.SimpleNamespace(total_memory=page * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        pass


def _import_torchtitan() -> None:
    """Import torchtitan on CPU: its device is torch's available accelerator or "cuda"."""
    # torch's modules that look for triton, imported (and its answer cached) before the stub
    import torch._dynamo  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch._inductor.utils  # noqa: F401
    import torch._utils
    import torch.distributed.pipelining  # noqa: F401
    import torch.nn.attention.flex_attention  # noqa: F401
    import torch.utils._triton

    torch.utils._triton.has_triton_package()
    torch.compile(lambda x: x)  # imports the compile stack (torchtitan compiles at import)
    get_type, get_module = torch._utils._get_available_device_type, torch._utils._get_device_module
    stubs = _triton_stub() if importlib.util.find_spec("triton") is None else {}
    torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
    torch._utils._get_device_module = lambda device=None: _CpuDevice()  # type: ignore[assignment]
    sys.modules.update(stubs)
    try:
        import torchtitan.distributed.fsdp  # noqa: F401
        import torchtitan.tools.utils  # noqa: F401  (binds device_type, device_module)
        import torchtitan.trainer  # noqa: F401
        for module, _ in MODELS.values():
            importlib.import_module(module)
    finally:
        torch._utils._get_available_device_type = get_type  # type: ignore[assignment]
        torch._utils._get_device_module = get_module  # type: ignore[assignment]
        for name in stubs:  # torch must not find a triton later
            sys.modules.pop(name, None)


def _math_flex_attention(q: Any, k: Any, v: Any, *, score_mod: Any = None, block_mask: Any = None,
                         scale: float | None = None, enable_gqa: bool = False,
                         return_aux: Any = None, kernel_options: Any = None) -> Any:
    """flex_attention(q, k, v, block_mask=...) in plain differentiable ops, in float32 as the
    kernels compute: torch's flex_attention has no backward on CPU. The mask is the block
    mask's mask_mod evaluated for every (batch, head, query, key)."""
    import torch
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("score_mod is not supported by this stand-in")
    batch, heads, q_len, dim = q.shape
    kv_len = k.shape[-2]
    if enable_gqa and k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scale = dim ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if block_mask is not None:
        mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
        mask = create_mask(block_mask.mask_mod, mask_batch, mask_heads, q_len, kv_len,
                           device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse.unsqueeze(-1)) @ v.float()).to(q.dtype)
    want_lse = return_aux is not None and getattr(return_aux, "lse", False)
    return out, AuxOutput(lse=lse if want_lse else None)


def _torch_compat() -> list[str]:
    """What torchtitan 0.3.0 calls that torch 2.13 lacks (it is built against a newer
    torch): torch.distributed.set_timeout, after the first step (set_pg_timeouts), made
    c10d's _set_pg_timeout. Returns what was added."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    added = []
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: c10d._set_pg_timeout(timeout, group)  # type: ignore[attr-defined]
        added.append("torch.distributed.set_timeout")
    return added


def _cpu_attention() -> None:
    """FlexAttention through _math_flex_attention and its masks uncompiled (torch.compile
    on CPU needs inductor's C++ toolchain, and flex_attention has no CPU backward); the
    same for both implementations."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = _math_flex_attention
    attention._compiled_create_block_mask = create_block_mask


def _synthetic_data_classes(vocab: int, seed: int) -> tuple[type, type]:
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class SyntheticTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = vocab

        def __init__(self, config: Any = None, **kwargs: Any) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size
            self.eos_id = 0

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class SyntheticDataLoader(BaseDataLoader):
        """Random tokens, one document per row: batch i of data-parallel rank r is drawn
        from a generator seeded by (seed, i, r)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            dataset: str = "synthetic"

        def __init__(self, config: Any = None, *, dp_world_size: int, dp_rank: int,
                     tokenizer: Any, seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
            self.dp_rank, self.seq_len, self.batch = dp_rank, seq_len, local_batch_size
            self.vocab = tokenizer.get_vocab_size()
            self.step = 0

        def __iter__(self) -> Any:
            while True:
                g = torch.Generator().manual_seed(
                    seed * 1_000_003 + self.step * 1009 + self.dp_rank)
                self.step += 1
                tokens = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=g)
                positions = torch.arange(self.seq_len).expand(self.batch, -1).contiguous()
                yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.step = state_dict.get("step", 0)

    return SyntheticTokenizer, SyntheticDataLoader


def _swap_in_fsdp_compose(mesh_dims: bool) -> list[str]:
    """Rebind, in every torchtitan module, each name it imported from torch's FSDP to
    fsdp_compose's (DataParallelMeshDims only with `mesh_dims`); and
    torch.distributed._composable.fsdp.FSDPModule, which torchtitan's ChunkedLossWrapper
    imports inside __call__. Returns what was rebound."""
    import torch.distributed._composable.fsdp as composable_fsdp
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_compose

    names = SWAPPED + ((MESH_DIMS,) if mesh_dims else ())
    torch_objects = {id(getattr(torch_fsdp, n)): n for n in names}
    torch_objects[id(composable_fsdp.FSDPModule)] = "FSDPModule"
    swapped = []
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("torchtitan") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            name = torch_objects.get(id(value))
            if name is not None:
                setattr(module, attr, getattr(fsdp_compose, name))
                swapped.append(f"{mod_name}.{attr}")
    composable_fsdp.FSDPModule = fsdp_compose.FSDPModule  # type: ignore[misc]
    swapped.append("torch.distributed._composable.fsdp.FSDPModule")
    return swapped


def _force_sum_reduction() -> None:
    """After torchtitan's disable_fsdp_gradient_division (gradient_divide_factor=1.0), also
    set_force_sum_reduction_for_comms(True) on every FSDP module: torch's fully_shard
    reduce-scatters a divide factor other than the group size with ReduceOp.PREMUL_SUM,
    which gloo has not ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); with it both reduce
    with SUM and divide by 1.0, the same numbers. Applied alike to both implementations."""
    import torchtitan.distributed.fsdp as ttf

    disable = ttf.disable_fsdp_gradient_division

    def disable_and_force_sum(model: Any) -> None:
        disable(model)
        for module in model.modules():
            if isinstance(module, ttf.FSDPModule):  # fsdp_compose's after the swap
                module.set_force_sum_reduction_for_comms(True)

    ttf.disable_fsdp_gradient_division = disable_and_force_sum


def _param_checksums(model: Any) -> dict[str, dict[str, Any]]:
    """sum, abs sum (float64) and sha256 of every parameter's full tensor (collective)."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        sharded = isinstance(param, DTensor)
        full = param.full_tensor() if sharded else param
        full = full.detach().cpu().contiguous()
        out[name] = {
            "shape": list(full.shape),
            "dtype": str(full.dtype),
            "sum": float(full.double().sum()),
            "abs_sum": float(full.double().abs().sum()),
            "sha256": hashlib.sha256(full.view(torch.uint8).numpy().tobytes()).hexdigest(),
            "dtensor": sharded,
            # the sharded parameter's DTensor spec, which checkpoints and optimizers see
            "placements": [str(p) for p in param.placements] if sharded else None,
            "mesh_dims": list(param.device_mesh.mesh_dim_names or ()) if sharded else None,
            "local_shape": list((param.to_local() if sharded else param).shape),
        }
    return out


# torch's public FSDP2 names, the ones replace_torch_fsdp (the launcher's switch) rebinds in
# torch.distributed.fsdp and its re-exports where torch has them.
FSDP_NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy",
              "OffloadPolicy", "CPUOffloadPolicy", "register_fsdp_forward_method",
              "share_comm_ctx", MESH_DIMS)


def _package(module: str) -> str:
    """'torch' or 'fsdp_compose' for a (dotted) name under either, else the name itself."""
    top = module.split(".")[0]
    return top if top in ("torch", "fsdp_compose") else module


def _switch_state() -> dict[str, str]:
    """`module.name` -> defining module of that object, for torch's public FSDP2 names in
    torch.distributed.fsdp and its re-exports (what a launcher's switch rebinds)."""
    state = {}
    for mod_name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp",
                     "torch.distributed.fsdp._fully_shard"):
        try:
            module = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name in FSDP_NAMES:
            if hasattr(module, name):
                state[f"{mod_name}.{name}"] = getattr(module, name).__module__
    return state


def _torchtitan_fsdp_names() -> dict[str, str]:
    """`module.attr` -> defining module, for every name a torchtitan module holds that is
    one of torch's or fsdp_compose's public FSDP2 objects (by name and defining package)."""
    held = {}
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("torchtitan") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            name = getattr(value, "__name__", None)
            home = getattr(value, "__module__", None) or ""
            if name in FSDP_NAMES and home.split(".")[0] in ("torch", "fsdp_compose") and (
                    home.startswith(("torch.distributed.fsdp", "torch.distributed._composable",
                                     "fsdp_compose"))):
                held[f"{mod_name}.{attr}"] = home
    return held


def _fsdp_classes(model: Any) -> dict[str, int]:
    """The FSDPModule class in the MRO of every module fully_shard annotated
    (`module.qualname` -> count): the proof of whose fully_shard ran, read off the classes
    themselves (under the launcher torch.distributed.fsdp.FSDPModule is fsdp_compose's, so
    an isinstance against it would not tell)."""
    found: dict[str, int] = {}
    for module in model.modules():
        bases = [c for c in type(module).__mro__ if c.__name__ == "FSDPModule"]
        for base in bases:
            key = f"{base.__module__}.{base.__qualname__}"
            found[key] = found.get(key, 0) + 1
    return found


def worker(args: argparse.Namespace) -> int:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {"args": vars(args), "ok": False, "steps": []}
    trainer = None
    try:
        # whose names torch.distributed.fsdp holds before torchtitan is imported: the
        # launcher's switch, or nothing
        result["switch_at_start"] = _switch_state()
        at_start = _package(result["switch_at_start"]["torch.distributed.fsdp.fully_shard"])
        want = "fsdp_compose" if args.impl == "launcher" else "torch"
        if at_start != want:
            raise RuntimeError(
                f"--impl {args.impl}: torch.distributed.fsdp.fully_shard is {at_start}'s at start, "
                f"expected {want}'s; " + ("start it as torchrun ... -m fsdp_compose.run "
                                          "tests/clients/torchtitan_parity.py --impl launcher ..."
                                          if want == "fsdp_compose" else
                                          "start it without python -m fsdp_compose.run"))
        _import_torchtitan()
        _cpu_attention()
        result["torch_compat"] = _torch_compat()
        import torchtitan.trainer  # noqa: F401
        from torchtitan.tools.logging import init_logger

        init_logger()
        # launcher: nothing rebound here; fsdp_compose got in through the launcher's switch
        result["swapped"] = (_swap_in_fsdp_compose(args.swap_mesh_dims)
                             if args.impl == "compose" else [])
        if not args.no_force_sum:
            _force_sum_reduction()
        module, fn = MODELS[args.model]
        config = getattr(importlib.import_module(module), fn)()
        vocab = config.model_spec.model.vocab_size
        tokenizer_cls, loader_cls = _synthetic_data_classes(vocab, args.seed)
        config.tokenizer = tokenizer_cls.Config()
        config.dataloader = loader_cls.Config()
        config.hf_assets_path = args.dump
        config.dump_folder = args.dump
        config.training.seq_len = args.seq_len
        config.training.local_batch_size = args.batch
        config.training.steps = args.steps
        config.training.disable_cuda_graphs = True
        config.training.mixed_precision_param = args.param_dtype
        config.parallelism.spmd_backend = args.backend
        config.parallelism.expert_parallel_degree = args.ep
        config.checkpoint.enable = False
        config.debug.seed = args.seed
        config.debug.enable_structured_logging = False
        config.metrics.log_freq = 1
        if args.no_ac:
            config.activation_checkpoint = None  # parallelize_fn skips AC on None

        trainer = config.build()
        recorded = result["steps"]
        log = trainer.metrics_processor.log

        def record(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                   *a: Any, **k: Any) -> Any:
            recorded.append({"step": step, "loss": float(global_avg_loss),
                             "max_loss": float(global_max_loss), "grad_norm": float(grad_norm)})
            return log(step, global_avg_loss, global_max_loss, grad_norm, *a, **k)

        trainer.metrics_processor.log = record
        t0 = time.perf_counter()
        trainer.train()
        result["train_s"] = time.perf_counter() - t0
        model = trainer.model_parts[0]
        result["params"] = _param_checksums(model)
        result["fsdp_classes"] = _fsdp_classes(model)
        result["units"] = {"torch": 0, "fsdp_compose": 0}  # which fully_shard annotated, counted
        for cls, n in result["fsdp_classes"].items():
            owner = _package(cls)
            result["units"][owner] = result["units"].get(owner, 0) + n
        result["switch_at_end"] = _switch_state()
        result["torchtitan_fsdp_names"] = _torchtitan_fsdp_names()
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001  (reported, then re-raised by exit code)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        print(f"[rank {rank}] {result['traceback']}", file=sys.stderr, flush=True)
    finally:
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.close()
    if rank == 0 or not result["ok"]:
        path = args.out if rank == 0 else f"{args.out}.rank{rank}"
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    with contextlib.suppress(Exception):
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0 if result["ok"] else 1


# ----------------------------------------------------------------------------- driver


def _run(
    config: dict[str, Any], impl: str, args: argparse.Namespace, workdir: str
) -> dict[str, Any]:
    tag = f"{config['model']}-{config['backend']}-w{config['world']}-ep{config['ep']}-{impl}"
    out = os.path.join(workdir, f"{tag}.json")
    dump = os.path.join(workdir, tag)
    os.makedirs(dump, exist_ok=True)
    # launcher: the way a user starts torchtitan under fsdp_compose (torchrun -m
    # fsdp_compose.run -m torchtitan.train ...); the worker then rebinds nothing itself
    launcher = ["-m", "fsdp_compose.run"] if impl == "launcher" else []
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={config['world']}", *launcher, os.path.abspath(__file__), "--worker",
        "--model", config["model"], "--backend", config["backend"], "--ep", str(config["ep"]),
        "--impl", impl, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
        "--batch", str(args.batch), "--seed", str(args.seed), "--param-dtype", args.param_dtype,
        "--out", out, "--dump", dump, *(["--no-ac"] if args.no_ac else []),
        *(["--no-force-sum"] if args.no_force_sum else []),
        # only compose takes it: under the launcher DataParallelMeshDims is always swapped
        *(["--swap-mesh-dims"] if args.swap_mesh_dims and impl == "compose" else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log_path = os.path.join(workdir, f"{tag}.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result: dict[str, Any] = {"ok": False}
    for path in [out] + [f"{out}.rank{r}" for r in range(config["world"])]:
        if os.path.exists(path):
            with open(path) as f:
                got = json.load(f)
            if not got.get("ok"):
                result = got
                break
            result = got
    result["rc"], result["log"], result["wall_s"] = rc, log_path, time.perf_counter() - t0
    if rc != 0 and result.get("ok"):
        result["ok"] = False
        result["error"] = f"torchrun exited {rc}"
    if not result.get("ok") and "error" not in result:
        result["error"] = f"torchrun exited {rc} with no result; see {log_path}"
    return result


def _compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    steps = min(len(a["steps"]), len(b["steps"]))
    pairs = list(zip(a["steps"], b["steps"]))
    loss = max((abs(x["loss"] - y["loss"]) for x, y in pairs), default=float("nan"))
    gnorm = max((abs(x["grad_norm"] - y["grad_norm"]) for x, y in pairs), default=float("nan"))
    pa, pb = a["params"], b["params"]
    names_match = list(pa) == list(pb)
    param = max((abs(pa[n]["sum"] - pb[n]["sum"]) for n in pa if n in pb), default=float("nan"))
    param_abs = max((abs(pa[n]["abs_sum"] - pb[n]["abs_sum"]) for n in pa if n in pb),
                    default=float("nan"))
    differing = [n for n in pa if n not in pb or pa[n]["sha256"] != pb[n]["sha256"]
                 or pa[n]["shape"] != pb[n]["shape"] or pa[n]["dtype"] != pb[n]["dtype"]]
    spec = ("dtensor", "placements", "mesh_dims", "local_shape")
    spec_differing = [f"{n}: {[pa[n].get(k) for k in spec]} vs {[pb[n].get(k) for k in spec]}"
                      for n in pa if n in pb and any(pa[n].get(k) != pb[n].get(k) for k in spec)]
    identical = (names_match and not differing and steps == len(a["steps"]) == len(b["steps"])
                 and all(x == y for x, y in pairs))
    return {"steps": steps, "loss_diff": loss, "grad_norm_diff": gnorm, "param_sum_diff": param,
            "param_abs_sum_diff": param_abs, "params_differing": differing,
            "names_match": names_match, "identical": identical, "spec_differing": spec_differing}


def _whose(got: dict[str, Any], impl: str) -> str | None:
    """Why a worker's result does not show the fully_shard its --impl asks for (None if it
    does): the FSDP classes of the annotated modules, and for the launcher that torch's
    names were fsdp_compose's before torchtitan was imported, that the worker rebound
    nothing itself, and that every FSDP name torchtitan holds is fsdp_compose's."""
    want = "torch" if impl == "torch" else "fsdp_compose"
    units = got.get("units") or {}
    if not units.get(want) or any(n for k, n in units.items() if k != want):
        return f"model annotated by the wrong fully_shard: {got.get('fsdp_classes')}"
    if impl == "launcher":
        if got.get("swapped"):
            return f"the launcher worker rebound names itself: {got['swapped'][:4]}"
        torch_names = {k: v for k, v in (got.get("switch_at_start") or {}).items()
                       if _package(v) != "fsdp_compose"}
        if not got.get("switch_at_start") or torch_names:
            return f"torch's names not switched before torchtitan was imported: {torch_names}"
        held = got.get("torchtitan_fsdp_names") or {}
        torch_held = {k: v for k, v in held.items() if _package(v) != "fsdp_compose"}
        if not held or torch_held:
            return f"torchtitan holds torch's FSDP names under the launcher: {torch_held}"
    return None


def driver(args: argparse.Namespace) -> int:
    workdir = args.workdir or tempfile.mkdtemp(prefix="tt_parity_")
    os.makedirs(workdir, exist_ok=True)
    impls = [i for i in dict.fromkeys(args.impl or ["compose"]) if i != "torch"]
    configs = [
        {"model": m, "backend": b, "world": w, "ep": e}
        for m in args.model for b in args.backend for w in args.world for e in args.ep
        if w % e == 0 and (e == 1 or m not in DENSE)
    ]
    rows = []
    header = (f"{'model':12} {'backend':16} {'world':>5} {'ep':>3} {'impl':8} {'steps':>5} "
              f"{'FSDP2 ran':9} {'impl ran':8} {'identical':9} {'max|dloss|':>11} "
              f"{'max|dparam sum|':>16} {'max|dgrad norm|':>15}")
    print(f"work dir: {workdir}\n{header}", flush=True)
    failed = False
    fmt = lambda v: "-" if v is None else f"{v:.3e}"  # noqa: E731
    for config in configs:
        ref = _run(config, "torch", args, workdir)
        if ref.get("ok") and (why := _whose(ref, "torch")):
            ref["ok"], ref["error"] = False, why
        stop = False
        for impl in impls:
            run_it = ref.get("ok") or args.compose_anyway
            new = _run(config, impl, args, workdir) if run_it else None
            if new and new.get("ok") and (why := _whose(new, impl)):
                new["ok"], new["error"] = False, why
            row = dict(config, impl=impl, fsdp2_ok=bool(ref.get("ok")),
                       impl_ok=bool(new and new.get("ok")), fsdp2_error=ref.get("error"),
                       impl_error=new and new.get("error"), fsdp2_log=ref.get("log"),
                       impl_log=new and new.get("log"))
            if new is not None:
                row["impl_fsdp_classes"] = new.get("fsdp_classes")
                row["impl_torchtitan_fsdp_names"] = new.get("torchtitan_fsdp_names")
            if ref.get("ok") and new and new.get("ok"):
                row.update(_compare(ref, new))
                row["losses_fsdp2"] = [s["loss"] for s in ref["steps"]]
                row["losses_impl"] = [s["loss"] for s in new["steps"]]
            rows.append(row)
            ident = row.get("identical")
            print(f"{config['model']:12} {config['backend']:16} {config['world']:>5} "
                  f"{config['ep']:>3} {impl:8} {row.get('steps', '-')!s:>5} "
                  f"{('yes' if row['fsdp2_ok'] else 'NO'):9} "
                  f"{('yes' if row['impl_ok'] else ('NO' if new else 'not run')):8} "
                  f"{('-' if ident is None else ('yes' if ident else 'NO')):9} "
                  f"{fmt(row.get('loss_diff')):>11} {fmt(row.get('param_sum_diff')):>16} "
                  f"{fmt(row.get('grad_norm_diff')):>15}", flush=True)
            if row["impl_ok"]:
                print(f"    {impl} ran fully_shard of: {row['impl_fsdp_classes']}", flush=True)
            for who in ("fsdp2", "impl"):
                if row.get(f"{who}_error"):
                    print(f"    {impl if who == 'impl' else who} failed: "
                          f"{row[f'{who}_error'][:400]} (log {row[f'{who}_log']})", flush=True)
            if row.get("params_differing"):
                print(f"    parameters differing: {row['params_differing'][:8]}"
                      f"{' ...' if len(row['params_differing']) > 8 else ''}", flush=True)
            if row.get("spec_differing"):
                print(f"    sharded DTensor specs differing ({len(row['spec_differing'])}): "
                      f"{row['spec_differing'][:3]}", flush=True)
            bad = row["fsdp2_ok"] and not row.get("identical")
            failed |= bad
            if bad and not args.keep_going:
                stop = True
                break
        if stop:
            break
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"results: {os.path.join(workdir, 'results.json')}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help="run as a torchrun worker")
    p.add_argument("--model", nargs="+", default=["deepseek_v3"], choices=sorted(MODELS))
    p.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--world", nargs="+", type=int, default=[2, 4])
    p.add_argument("--ep", nargs="+", type=int, default=[1, 2])
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=None,
                   help="worker: the one implementation to run (default torch; launcher only "
                        "under python -m fsdp_compose.run); driver: those to compare with "
                        "torch's fully_shard, which always runs (default compose)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="local batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="training.mixed_precision_param (torchtitan's default: bfloat16)")
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    p.add_argument("--no-force-sum", action="store_true",
                   help="keep torchtitan's reduction as it is (torch's fully_shard then fails "
                        "on gloo: PREMUL_SUM); by default both reduce with SUM")
    p.add_argument("--swap-mesh-dims", action="store_true",
                   help="with --impl compose, also rebind torchtitan's DataParallelMeshDims "
                        "to fsdp_compose's (by default torchtitan keeps torch's, which "
                        "fsdp_compose accepts); --impl launcher always swaps it, as the "
                        "launcher does, and is not passed the flag")
    p.add_argument("--out", default="result.json")
    p.add_argument("--dump", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--timeout", type=int, default=900, help="seconds per torchrun")
    p.add_argument("--keep-going", action="store_true")
    p.add_argument("--compose-anyway", action="store_true",
                   help="run fsdp_compose even where FSDP2 itself failed")
    args = p.parse_args()
    if args.worker:
        if len(args.model) != 1 or len(args.backend) != 1 or len(args.ep) != 1 or (
                args.impl is not None and len(args.impl) != 1):
            p.error("a worker runs one --model, --backend, --ep and --impl")
        args.model, args.backend, args.ep = args.model[0], args.backend[0], args.ep[0]
        args.impl = args.impl[0] if args.impl else "torch"
        if args.impl == "launcher" and args.swap_mesh_dims:
            p.error("--swap-mesh-dims is for --impl compose: under the launcher torchtitan "
                    "already holds fsdp_compose's DataParallelMeshDims")
        args.dump = args.dump or tempfile.mkdtemp(prefix="tt_dump_")
        return worker(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
