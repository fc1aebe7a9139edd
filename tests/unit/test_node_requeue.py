"""``node_requeue.other_node_of_two``: which node the survivor of a two-node job asks SLURM
about, from the step's own variables (``SLURM_STEP_NODELIST``, ``SLURMD_NODENAME``): the
step's first node, where node rank 0 and the store run, asked by the second."""

from __future__ import annotations

import pytest

from nvrx.supervisor.node_requeue import other_node_of_two


@pytest.mark.parametrize(
    ("own", "nodelist", "first"),
    [
        ("node2", "node[1-2]", "node1"),
        ("node1", "node[2,1]", "node2"),
        ("gpu-b", "gpu-a,gpu-b", "gpu-a"),
    ],
)
def test_the_second_node_of_a_two_node_step_asks_about_the_first(
    own: str, nodelist: str, first: str
) -> None:
    env = {"SLURMD_NODENAME": own, "SLURM_STEP_NODELIST": nodelist}
    assert other_node_of_two(env) == first


@pytest.mark.parametrize(
    "env",
    [
        {"SLURMD_NODENAME": "node1", "SLURM_STEP_NODELIST": "node[1-2]"},  # the first itself
        {"SLURMD_NODENAME": "node3", "SLURM_STEP_NODELIST": "node[1-2]"},  # not one of them
        {"SLURMD_NODENAME": "node2", "SLURM_STEP_NODELIST": "node[1-3]"},  # three nodes
        {"SLURMD_NODENAME": "node1", "SLURM_STEP_NODELIST": "node1"},  # one node
        {"SLURMD_NODENAME": "node1", "SLURM_STEP_NODELIST": "node[1,1]"},  # one node twice
        {"SLURMD_NODENAME": "node2", "SLURM_STEP_NODELIST": "node[1-"},  # malformed
        {"SLURM_STEP_NODELIST": "node[1-2]"},  # not on a SLURM node
        {},  # not under SLURM
    ],
)
def test_no_node_is_asked_about_unless_this_is_the_second_of_two(env: dict[str, str]) -> None:
    assert other_node_of_two(env) is None
