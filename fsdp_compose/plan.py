"""python -m fsdp_compose.plan: rank setups of the example GPT or a Hugging Face Llama
before running them (see fsdp_compose.plan).

    python -m fsdp_compose.plan --model gpt --world-size 8 --budget 64MiB
    python -m fsdp_compose.plan --model llama --world-size 64 --dim 512 --depth 8 --budget 1GiB

Sizes and batches are one rank's; a budget's MiB/GiB are binary (2^20, 2^30 bytes), its
MB/GB decimal (10^6, 10^9), a bare number bytes. The GPT is examples/train_gpt.py's (from
a source checkout), the Llama transformers' LlamaForCausalLM with a tiny config unless
told. Which setup it is simulating goes to stderr as it goes; the ranked table to stdout.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .tools.planner import Plan, parse_size, plan, ranking, size, table

__all__ = ["main", "parse_size"]


def _budget_argument(text: str) -> str:
    """--budget, checked as plan() parses a string memory_budget (argparse shows its
    message), and kept as written: the output says what it was read as."""
    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def _gpt(args: argparse.Namespace) -> Callable[[], nn.Module]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from train_gpt import GPT  # type: ignore[import-not-found]

    def build() -> nn.Module:
        torch.manual_seed(0)
        model: nn.Module = GPT(args.vocab, args.dim, args.heads, args.depth, args.seq)
        return model
    return build


def _llama(args: argparse.Namespace) -> Callable[[], nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim,
        num_hidden_layers=args.depth, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
    )

    def build() -> nn.Module:
        torch.manual_seed(0)
        model: nn.Module = LlamaForCausalLM(config)
        return model
    return build


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--budget", type=_budget_argument,
                        help="memory per rank: 64MiB (2^20 bytes each), 64MB (10^6), 2048 (bytes)")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    args = parser.parse_args(argv)
    tokens = torch.randint(args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    if args.model == "gpt":
        build = _gpt(args)

        def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
            logits = model(batch[:, :-1])
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    else:
        build = _llama(args)

        def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
            return model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]
    budget = None if args.budget is None else parse_size(args.budget)
    plans = plan(build, world_size=args.world_size, sample_input=tokens,
                 memory_budget=budget, loss_fn=loss)
    _report(args, budget, plans)


def _report(args: argparse.Namespace, budget: int | None, plans: list[Plan]) -> None:
    """The budget as read, how the setups are ranked, their table, and the calls of the
    best one, or why there are none."""
    read = "" if budget is None else (
        f", budget {args.budget} = {budget:,} bytes ({size(budget)}) per rank")
    print(f"{args.model}, {args.world_size} ranks{read}.")
    print(textwrap.fill(ranking(budget is not None) + " Best first:", width=92) + "\n")
    print(table(plans))
    best = plans[0]
    if best.fits is not False:
        print("\nrealised by:\n" + best.code)
    else:
        print("\nno setup fits the budget (nearest first above): more ranks, or a smaller "
              "batch per rank")


class _CallableModule(types.ModuleType):
    """Importing this module (`import fsdp_compose.plan`) makes `fsdp_compose.plan` the
    module rather than the function: calling it still plans."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[Plan]:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
