"""SLURM's node states read for one question: does the node itself answer?"""

from __future__ import annotations

import pytest

from nvrx.slurm.node_state import NodeHealth, node_health


@pytest.mark.parametrize(
    ("state", "health"),
    [
        ("MIXED", NodeHealth.RESPONDING),  # a killed supervisor's node: slurmd still answers
        ("ALLOCATED", NodeHealth.RESPONDING),
        ("IDLE+DRAIN", NodeHealth.RESPONDING),  # drained by an admin, not failed
        ("MIXED+COMPLETING", NodeHealth.RESPONDING),
        ("IDLE+NOT_RESPONDING", NodeHealth.FAILED),  # a crashed node, before SLURM marks it down
        ("MIXED+NOT_RESPONDING", NodeHealth.FAILED),
        ("DOWN", NodeHealth.FAILED),
        ("DOWN+DRAIN", NodeHealth.FAILED),
        ("FAIL", NodeHealth.FAILED),
        ("down*", NodeHealth.FAILED),  # sinfo's not-responding mark
        ("mix*", NodeHealth.FAILED),
        ("", NodeHealth.UNKNOWN),
        (None, NodeHealth.UNKNOWN),
    ],
)
def test_node_health(state: str | None, health: NodeHealth) -> None:
    assert node_health(state) is health
