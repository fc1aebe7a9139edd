"""The torch floor in pyproject.toml is no older than the first release with every torch API nvrx calls.

Each entry names the API, the torch release that first shipped it, and where that comes
from (the pull request that added it and its merge date; torch branches for a release
about two months before it ships). Adding a call to a newer API means adding it here,
which raises the floor when the API is newer than it. The floor may be higher: it is also
the torch that scripts/setup.sh installs and the tests run on.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

#: API -> (first release, evidence)
APIS = {
    "Store.clone": ((2, 8), "pytorch/pytorch#151045, merged 2025-04-10, after the 2.7 branch"),
    "Store.list_keys": ((2, 10), "pytorch/pytorch#167883, merged 2025-11-21, after the 2.9 branch"),
}


def _floor() -> tuple[int, ...]:
    """The torch floor of pyproject.toml's dependencies (a plain ``torch>=X.Y``)."""
    found = re.findall(r'^\s*"torch([^"]*)",?$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert len(found) == 1, f"one torch dependency expected, found {found}"
    match = re.fullmatch(r">=(\d+)\.(\d+)(?:\.\d+)?", found[0])
    assert match, f"torch dependency 'torch{found[0]}' is not a plain floor"
    return int(match[1]), int(match[2])


def test_the_floor_has_the_newest_api_we_call() -> None:
    assert _floor() >= max(release for release, _ in APIS.values())


def test_the_installed_torch_has_every_api() -> None:
    for api in APIS:
        owner, name = api.split(".")
        assert hasattr(getattr(dist, owner), name), f"{api} missing in torch {torch.__version__}"
