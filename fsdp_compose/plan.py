"""python -m fsdp_compose.plan: rank setups of your model, the example GPT or a Hugging Face
Llama before running them (see fsdp_compose.plan).

    python -m fsdp_compose.plan --model llama --world-size 64 --dim 512 --depth 8 --budget 1GiB
    python -m fsdp_compose.plan --model mypackage.models:build --world-size 8 --budget 1GiB

`factory()` returns `(model, sample_input)` or `(model, sample_input, loss_fn)` (default loss:
the output's sum). The GPT is examples/train_gpt.py's, the Llama transformers'. Sizes and
batches are one rank's; progress goes to stderr, the table to stdout."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import textwrap
import types
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .tools.planner import LossFn, Plan, parse_size, plan, ranking, size, table

__all__ = ["main", "parse_size"]


def _factory(spec: str) -> tuple[Callable[[], nn.Module], Any, LossFn | None]:
    """`package.module:factory` imported; its builder, sample input and loss (None: default)."""
    module_name, name = spec.split(":")
    sys.path.insert(0, os.getcwd())  # as python -m finds the current folder's modules
    factory = getattr(importlib.import_module(module_name), name)
    made = factory()
    return lambda: factory()[0], made[1], (made[2] if len(made) > 2 else None)


def _model(args: argparse.Namespace) -> tuple[Callable[[], nn.Module], torch.Tensor, LossFn]:
    """The builder of the model `args` describe, a batch of random tokens, and its loss."""
    batch = torch.randint(args.vocab, (args.batch, args.seq),
                          generator=torch.Generator().manual_seed(0))
    if args.model == "gpt":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from train_gpt import GPT  # type: ignore[import-not-found]

        def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
            logits = model(batch[:, :-1])
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        return partial(GPT, args.vocab, args.dim, args.heads, args.depth, args.seq), batch, loss
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, num_hidden_layers=args.depth,
                         intermediate_size=4 * args.dim, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 2),
                         max_position_embeddings=args.seq)

    def llama_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]
    return partial(LlamaForCausalLM, config), batch, llama_loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_compose.plan", description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="gpt",
                        help="gpt, llama, or package.module:factory() -> (model, sample_input)")
    parser.add_argument("--world-size", type=int, default=8, help="ranks simulated")
    parser.add_argument("--budget", help="memory per rank: 64MiB (2^20 bytes each), 64MB (10^6), "
                        "2048 (bytes)")
    for flag, default in dict(vocab=128, dim=64, heads=4, depth=4, seq=32).items():
        parser.add_argument(f"--{flag}", type=int, default=default, help="gpt and llama only")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank (gpt, llama)")
    args = parser.parse_args(argv)
    if args.model not in ("gpt", "llama") and not re.fullmatch(r"[\w.]+:\w+", args.model):
        parser.error(f"argument --model: {args.model!r} is not gpt, llama or package.module:"
                     "factory (a function returning (model, sample_input))")
    try:  # before any model is built
        budget = None if args.budget is None else parse_size(args.budget)
    except ValueError as e:
        parser.error(f"argument --budget: {e}")
    make, sample, loss = _factory(args.model) if ":" in args.model else _model(args)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return make()
    plans = plan(build, world_size=args.world_size, sample_input=sample, memory_budget=budget,
                 loss_fn=loss)
    # The budget as read, how the setups are ranked, their table, and the best one's calls.
    read = "" if budget is None else (
        f", budget {args.budget.strip()} = {budget:,} bytes ({size(budget)}) per rank")
    print(f"{args.model}, {args.world_size} ranks{read}.")
    print(textwrap.fill(ranking(budget is not None) + " Best first:", width=92) + "\n")
    print(table(plans))
    print("\nrealised by:\n" + plans[0].code if plans[0].fits is not False else "\nno setup fits "
          "the budget (nearest first above): more ranks, or a smaller batch per rank")


class _CallableModule(types.ModuleType):
    """Once imported, `fsdp_compose.plan` is this module, not the function: calling it plans."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[Plan]:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
