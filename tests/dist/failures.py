"""Failures injected into a step: an exception in forward or in backward."""

from __future__ import annotations

import torch
from torch import nn


class Injected(Exception):
    pass


def raise_in_forward(model: nn.Module) -> None:
    """Make the next forward raise inside the second block (after the first ran)."""
    def fail(*_: object) -> None:
        handle.remove()
        raise Injected("forward")
    handle = model.blocks[1].fc1.register_forward_hook(fail)


def raise_in_backward(model: nn.Module) -> None:
    """Make the next backward raise once the last block's backward is done (the head,
    the root and the last block have reduced by then), before the first block's."""
    def register(_: nn.Module, __: object, output: torch.Tensor) -> None:
        handle.remove()
        output.register_hook(lambda _: (_ for _ in ()).throw(Injected("backward")))
    handle = model.blocks[0].register_forward_hook(register)
