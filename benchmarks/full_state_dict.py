"""Rank 0's peak memory writing a whole checkpoint of a sharded model (the GPT of
examples/train_gpt.py, a Hugging Face Llama): save_full_state_dict, streamed, against DCP's full
state dict and safetensors' save_file; the resident set's high-water mark (Linux) above before.

    torchrun --nproc_per_node=2 benchmarks/full_state_dict.py
"""

from __future__ import annotations

import ctypes
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness
import report
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from train_gpt import GPT
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_compose import save_full_state_dict

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LIBC = ctypes.CDLL("libc.so.6")


def rss_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def peak_extra(write: Callable[[], object]) -> dict[str, float]:
    """The peak resident memory during `write()` above what was held before (MiB), and
    the seconds it took."""
    gc.collect()
    LIBC.malloc_trim(0)
    dist.barrier()
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    start = time.perf_counter()
    write()
    seconds = time.perf_counter() - start
    dist.barrier()
    return {"peak_extra_mib": (rss_kib("VmHWM") - before) / 1024, "seconds": seconds}


def dcp_whole_then_save(model: torch.nn.Module, path: Path) -> None:
    """What a full checkpoint costs without streaming: the whole state dict on rank 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        seen: set[int] = set()
        tensors = {}
        for key, tensor in whole.items():  # safetensors stores no aliases: copy tied ones
            storage = tensor.untyped_storage().data_ptr()
            tensors[key] = tensor.clone() if storage in seen else tensor.contiguous()
            seen.add(storage)
        save_file(tensors, path / "model.safetensors")
    del whole


def models(vocab: int, dim: int, depth: int, seq: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    llama = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=depth,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq,
        tie_word_embeddings=False)
    built = {"example GPT": GPT(vocab, dim, 8, depth, seq), "HF Llama": LlamaForCausalLM(llama)}
    for model in built.values():
        harness.shard(model, model.model.layers if hasattr(model, "model") else model.blocks)
    return built


def main() -> None:
    parser = harness.parser(__doc__)
    for name, default in (("vocab", 32000), ("dim", 512), ("depth", 8), ("seq", 256)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    # Every allocation from 64 KiB up mapped on its own and unmapped when freed, so the
    # resident set follows the tensors alive (else freed heap memory is reused unseen).
    LIBC.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    with harness.process_group("gloo"):
        torch.set_num_threads(1)
        results = {}
        for name, model in models(args.vocab, args.dim, args.depth, args.seq).items():
            sizes = [p.numel() * p.element_size() for p in model.state_dict().values()]
            row = {"whole_mib": sum(sizes) / 2**20, "largest_tensor_mib": max(sizes) / 2**20}
            with tempfile.TemporaryDirectory() as tmp:
                # Once untimed: the first collectives and writes set up buffers of their own.
                save_full_state_dict(model, Path(tmp) / "warm-up")
                (Path(tmp) / "a").mkdir()
                row["save_full_state_dict"] = peak_extra(
                    lambda m=model: save_full_state_dict(m, Path(tmp) / "a"))
                row["DCP full state dict"] = peak_extra(
                    lambda m=model: dcp_whole_then_save(m, Path(tmp)))
            results[name] = row
        if dist.get_rank() == 0:
            result = {"config": harness.config(args, world_size=dist.get_world_size()),
                      "models": results}
            harness.write(args.out, "full_state_dict", result)
            print(report.full_state_dict_table(result))


if __name__ == "__main__":
    main()
