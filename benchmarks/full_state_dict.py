"""Rank 0's peak memory while writing a whole checkpoint of a sharded model:
fsdp_compose.save_full_state_dict (streamed, a tensor at a time) against
torch.distributed.checkpoint's get_model_state_dict(full_state_dict=True,
cpu_offload=True) followed by safetensors' save_file (the whole model on rank 0), for the
GPT of examples/train_gpt.py and a Hugging Face Llama.

    torchrun --nproc_per_node=2 benchmarks/full_state_dict.py

Memory is the process's resident set (Linux): its high-water mark is reset before each
write (/proc/self/clear_refs) and read after; the figure is that peak minus the resident
set before the write, with every allocation of 64 KiB or more mapped on its own (glibc's
M_MMAP_THRESHOLD) so that freed tensors leave the resident set. Each way of writing runs in
turn on the same sharded model, after one untimed write. Rank 0 prints a table and
writes full_state_dict.json to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import provenance
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_compose import fully_shard, save_full_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT  # noqa: E402

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_extra_mib(write) -> tuple[float, float]:
    """(rank 0's peak resident memory during `write()` above what it held before, MiB; seconds)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    start = time.perf_counter()
    write()
    seconds = time.perf_counter() - start
    dist.barrier()
    return (rss_kib("VmHWM") - before) / 1024, seconds


def dcp_whole_then_save(model: torch.nn.Module, path: Path) -> None:
    """What a full checkpoint costs without streaming: the whole state dict on rank 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        seen: set[int] = set()
        tensors = {}
        for key, tensor in whole.items():  # safetensors stores no aliases: copy tied ones
            shared = tensor.untyped_storage().data_ptr() in seen
            seen.add(tensor.untyped_storage().data_ptr())
            tensors[key] = tensor.clone() if shared else tensor.contiguous()
        save_file(tensors, path / "model.safetensors")
    del whole


def models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    llama = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim,
        num_hidden_layers=args.depth, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )
    return {
        "example GPT": GPT(args.vocab, args.dim, 8, args.depth, args.seq),
        "HF Llama": LlamaForCausalLM(llama),
    }


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers) if hasattr(model, "model") else list(model.blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    # Every allocation from 64 KiB up mapped on its own and unmapped when freed, so the
    # resident set follows the tensors alive (else freed heap memory is reused unseen).
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results = {}
    for name, model in models(args).items():
        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
        sizes = [p.numel() * p.element_size() for p in model.state_dict().values()]
        row = {"whole_mib": sum(sizes) / 2**20, "largest_tensor_mib": max(sizes) / 2**20}
        with tempfile.TemporaryDirectory() as tmp:
            # Once untimed: the first collectives and writes set up buffers of their own.
            save_full_state_dict(model, Path(tmp) / "warm-up")
            for way, write in (
                ("save_full_state_dict", lambda m=model: save_full_state_dict(m, Path(tmp) / "a")),
                ("DCP full state dict", lambda m=model: dcp_whole_then_save(m, Path(tmp))),
            ):
                (Path(tmp) / "a").mkdir(exist_ok=True)
                row[way] = dict(zip(("peak_extra_mib", "seconds"), peak_extra_mib(write)))
        results[name] = row
    if rank == 0:
        print(f"rank 0, {dist.get_world_size()} ranks (gloo), float32")
        print(f"{'model':<14}{'whole MiB':>11}{'largest':>9}{'streamed MiB':>14}{'DCP MiB':>10}{'ratio':>7}")
        for name, row in results.items():
            streamed = row["save_full_state_dict"]["peak_extra_mib"]
            dcp = row["DCP full state dict"]["peak_extra_mib"]
            print(f"{name:<14}{row['whole_mib']:>11.1f}{row['largest_tensor_mib']:>9.1f}"
                  f"{streamed:>14.1f}{dcp:>10.1f}{streamed / dcp:>7.2f}")
        args.out.mkdir(parents=True, exist_ok=True)
        config = {**{k: v for k, v in vars(args).items() if k != "out"}, **provenance()}
        config["world_size"] = dist.get_world_size()
        (args.out / "full_state_dict.json").write_text(
            json.dumps({"config": config, "models": results}, indent=1, default=str)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
