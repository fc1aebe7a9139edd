"""nvrx.slurm.nodelist agrees with SLURM's own parser, ``scontrol show hostnames``."""

from __future__ import annotations

import random

import pytest

from nvrx.slurm import commands
from nvrx.slurm.commands import SlurmCommandError
from nvrx.slurm.nodelist import compress_nodelist, expand_nodelist
from tests.support.slurm_cluster import LocalSlurmCluster

pytestmark = pytest.mark.timeout(120)

VALID = [
    "node1",
    "gpu[01-04,07],cpu-a[1-2]",
    "n[8-10]",
    "n[08-10]",
    "n[1-010]",
    "n[1,02]",
    "n[0001-3]",
    "n[9-11]",
    "a[1-2]b[3-4]",
    "x[1-2][3-4]",
    "rack[1-2]-n[01-02]",
    "n[1-2]-[3]",
    "[1-2]",
    "n[1-2,5-6,3]",
    "n[1-2],n[1-2]",
    "n[1,1]",
    "a,,b",
    ",a",
    "a,",
    "a b,c",
    "x1y[1-2]",
    "a;b",
    "n01,n1",
]

#: Rejected by both. (Where SLURM is lenient and we are not — ``n[1-]``,
#: ``n[1-2``, ``n1-2]``, ``n[ 1-2]`` — see the nvrx.slurm.nodelist docstring.)
INVALID = [
    "n[5-3]",
    "n[010-8]",
    "n[]",
    "n[a-b]",
    "n[-1]",
    "n[1-2,]",
    "n[1-2]x",
    "a[1-3]-b",
    "n[[1]]",
    "n[1-2]]",
    "n[1-3]a[5-6]b",
]


@pytest.mark.parametrize("nodelist", VALID)
def test_same_names_as_scontrol(slurm_cluster: LocalSlurmCluster, nodelist: str) -> None:
    assert expand_nodelist(nodelist) == commands.show_hostnames(nodelist, env=slurm_cluster.env)


@pytest.mark.parametrize("nodelist", INVALID)
def test_rejected_like_scontrol(slurm_cluster: LocalSlurmCluster, nodelist: str) -> None:
    with pytest.raises(SlurmCommandError):
        commands.show_hostnames(nodelist, env=slurm_cluster.env)
    with pytest.raises(ValueError):
        expand_nodelist(nodelist)


def test_compressed_lists_read_back_by_scontrol(slurm_cluster: LocalSlurmCluster) -> None:
    """What we write, SLURM reads as the same names (random lists, fixed seed)."""
    rng = random.Random(1234)
    for _ in range(40):
        names = []
        for _ in range(rng.randint(1, 12)):
            prefix = rng.choice(["gpu", "n", "rack1-n", "cpu-a", "x"])
            width = rng.randint(1, 3)
            names.append(f"{prefix}{rng.randint(0, 120):0{width}d}")
        if rng.random() < 0.5:
            names.sort()
        nodelist = compress_nodelist(names)
        assert commands.show_hostnames(nodelist, env=slurm_cluster.env) == names, nodelist
