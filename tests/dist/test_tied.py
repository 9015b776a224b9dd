"""Parameters tied across units (an embedding and the LM head that shares its weight), in
parity with single-process training: torch's fully_shard refuses them. One unit owns the
parameter, the other borrows it; its gradient, summed over both uses, is reduced once."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_compose import fully_shard
from tests.dist.counting import REDUCE_SCATTER, CollectiveCounter
from tests.dist.parity import assert_close_to, backward, full, optimizer_step
from tests.models import Transformer, lm_loss, token_batch


def siblings_embedding_first(model: Transformer) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model.tok_emb)
    fully_shard(model.head)  # borrows the embedding's weight
    fully_shard(model)


def siblings_head_first(model: Transformer) -> None:
    fully_shard(model.head)  # owns it; the embedding, which runs first, borrows it
    fully_shard(model.tok_emb)
    fully_shard(model)


def inner_and_root(model: Transformer) -> None:
    fully_shard(model.tok_emb)
    fully_shard(model)  # the root's head borrows the inner unit's weight


WRAPS: dict[str, Callable[[Transformer], None]] = {
    "siblings, embedding first": siblings_embedding_first,
    "siblings, head first": siblings_head_first,
    "inner unit and root": inner_and_root,
}


def check_tied_across_units(wrap: str, steps: int) -> tuple[float, list[int]]:
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = Transformer(tie_weights=True)
    ours = copy.deepcopy(ref)
    WRAPS[wrap](ours)
    assert ours.head.weight is ours.tok_emb.weight and isinstance(ours.head.weight, DTensor)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    worst, reductions = 0.0, []
    for step in range(steps):
        with CollectiveCounter() as counter:
            backward((ref, ours), token_batch(step, 2 * world), lm_loss)
        reductions.append(counter.counts[REDUCE_SCATTER])
        worst = max(worst, assert_close_to(ours, ref, grads=True, where=f"{wrap}, step {step}"))
        optimizer_step(optims)
    with torch.no_grad():  # a forward without grad leaves every unit sharded
        lm_loss(ours, token_batch(9, 2))
    assert all(isinstance(p, DTensor) for p in ours.parameters())
    state = {k: full(v) for k, v in ours.state_dict().items()}
    assert torch.equal(state["head.weight"], state["tok_emb.weight"])
    return max(worst, assert_close_to(ours, ref, where=f"{wrap}, trained")), reductions


def test_parameters_tied_across_units_train_like_single_process(ranks):
    for wrap in WRAPS:
        for error, reductions in ranks.run(check_tied_across_units, world_size=2, wrap=wrap,
                                           steps=3):
            assert error < 1e-5, wrap
            # One per unit with parameters of its own (a head without bias that borrows its
            # weight has none): the tied weight is reduced once, by its owner.
            owning_units = 4 if wrap == "siblings, embedding first" else 2
            assert reductions == [owning_units] * 3, (wrap, reductions)
