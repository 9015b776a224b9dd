"""Which submodules a WrapPolicy makes units (no process group needed)."""

from __future__ import annotations

import pytest
from torch import nn

from fsdp_compose import WrapPolicy, wrap
from fsdp_compose.api.wrap import chosen_modules
from tests.models import Block, Transformer


def names(model: nn.Module, policy: WrapPolicy) -> list[str]:
    fqns = {id(m): fqn for fqn, m in model.named_modules()}
    return [fqns[id(m)] for m in chosen_modules(model, policy)]


def test_by_class_chooses_each_block_bottom_up():
    model = Transformer(depth=3)
    assert names(model, WrapPolicy(module_classes=(Block,))) == ["blocks.0", "blocks.1", "blocks.2"]


def test_by_size_counts_parameters_not_already_chosen():
    model = Transformer(vocab=31, dim=12, depth=2)
    # A block has 12*36 + 12*12+12 + 12*36+36 + 36*12+12 + 4*12 = 1524 parameters; with
    # the blocks chosen, their ModuleList has none left, and the root is never chosen.
    assert names(model, WrapPolicy(min_params=1000)) == ["blocks.0", "blocks.1"]
    # Above a block's size, the list of blocks is the first module large enough.
    assert names(model, WrapPolicy(min_params=2000)) == ["blocks"]


def test_by_predicate_and_rules_combined():
    model = Transformer(depth=2)
    policy = WrapPolicy(module_classes=(Block,), predicate=lambda fqn, m: fqn == "head")
    assert names(model, policy) == ["blocks.0", "blocks.1", "head"]


def test_policy_type_is_checked():
    with pytest.raises(TypeError, match="policy must be a fsdp_compose.WrapPolicy, got type"):
        wrap(Transformer(), Block)
