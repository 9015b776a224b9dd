"""The planner's model and a real run's tracked peak, to compare plan() with."""

from __future__ import annotations

import torch

from fsdp_compose import Setup
from tests.models import Transformer, lm_loss


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(dim=32, heads=4, depth=4)


def measured_peak(setup: Setup, model: torch.nn.Module, tokens: torch.Tensor,
                  device: torch.device) -> int:
    """The tracked peak on `device` of two real AdamW steps of `model` annotated by `setup`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    setup.apply(model, "blocks")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        for _ in range(2):
            lm_loss(model, tokens).backward()
            optim.step()
            optim.zero_grad()
            tracker.reset_mod_stats()
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"])
