"""The module hooks under torch.compile: run eagerly, outside the graph. They communicate
and resize storage, which graphs cannot hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _call(hook: Callable[..., Any], *args: Any) -> Any:
    return hook(*args)


# The hooks call this first thing when torch.compile traces them (dynamo reads
# is_dynamo_compiling() as True), so compilation breaks the graph around them. Eager calls
# go straight on, unwrapped.
run_eagerly: Callable[..., Any] = torch.compiler.disable(_call)
