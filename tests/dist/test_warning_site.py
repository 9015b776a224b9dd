"""UnmanagedParametersWarning points at the user's line that ran the forward, not at torch's
module.py: a filter on the user's module catches it, a filter on torch does not hide it."""

from __future__ import annotations

import re
import warnings

import torch
import torch.nn.functional as F

from fsdp_compose import UnmanagedParametersWarning, fully_shard
from tests.models import Transformer, token_batch


def _blocks_only() -> Transformer:
    """Blocks annotated, the root not: its embeddings, norm and head are in no unit."""
    torch.manual_seed(0)
    model = Transformer()
    for block in model.blocks:
        fully_shard(block)
    return model


def _train_step(model: Transformer) -> None:
    tokens = token_batch(0, 2)
    logits = model(tokens[:, :-1])  # the user's call: the warning's site
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()


def _said(module_filter: str | None) -> list[tuple[str, str]]:
    """(filename, message) of each UnmanagedParametersWarning at a fresh model's first step,
    with an "ignore" filter on `module_filter` if any."""
    model = _blocks_only()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if module_filter is not None:
            warnings.filterwarnings(
                "ignore", category=UnmanagedParametersWarning, module=module_filter
            )
        _train_step(model)
    return [(w.filename, str(w.message)) for w in caught
            if w.category is UnmanagedParametersWarning]


def check_warning_site() -> dict[str, list[tuple[str, str]]]:
    return {
        "unfiltered": _said(None),
        "filtered here": _said(re.escape(__name__)),
        "filtered on torch": _said("torch"),
    }


def test_warning_points_at_the_users_call(ranks):
    for said in ranks.run(check_warning_site, world_size=2):
        assert len(said["unfiltered"]) == 1
        filename, message = said["unfiltered"][0]
        assert filename == __file__, filename
        assert message.startswith("fsdp_compose: Transformer holds fully_shard units")
        assert said["filtered here"] == []  # a filter on the user's module catches it
        assert said["filtered on torch"] == said["unfiltered"]  # one on torch does not
