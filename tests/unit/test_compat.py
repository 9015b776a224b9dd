"""fsdp_compose/comm/compat.py: the one module that names a torch version, and what it
picks on the torch under test (CI runs this file on the oldest and the pinned torch)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from torch.distributed import ProcessGroup

import fsdp_compose
from fsdp_compose.comm.compat import ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD, _release

PACKAGE = Path(fsdp_compose.__file__).parent
COMPAT = Path(inspect.getfile(_release))  # wherever the package keeps it
# A torch version number (2.11 ... 2.19), or code that reads the version.
VERSION_MENTION = re.compile(r"\b2\.1\d\b|__version__|torch_version|TorchVersion")


def test_release_of_builds_and_pre_releases():
    assert _release("2.11.0+cu130") == (2, 11)
    assert _release("2.13.0+cpu") == (2, 13)
    assert _release("2.15.0a0+git1a2b3c4") == (2, 15)  # a source build of 2.15 has 2.15's API


def test_the_collectives_picked_exist_on_this_torch():
    assert callable(getattr(ProcessGroup, ALL_GATHER_METHOD))
    assert callable(getattr(ProcessGroup, REDUCE_SCATTER_METHOD))


def test_only_compat_names_a_torch_version():
    mentions = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if VERSION_MENTION.search(line)
    ]
    where = COMPAT.relative_to(PACKAGE.parent)
    assert not mentions, f"torch versions belong in {where}:\n" + "\n".join(mentions)
