"""``fork_and_monitor``'s child keeps the launcher's place on its node: ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` (and its node: ``GROUP_RANK``, ``GROUP_WORLD_SIZE``) as torchrun (or
SLURM) gave them, not those of its one-rank monitor; all from one source, so that they agree."""

from __future__ import annotations

import pytest

from nvrx.supervisor.fork_and_monitor import launcher_place

_SLURM = {"SLURM_LOCALID": "3", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "8,4", "SLURM_STEP_NUM_NODES": "2"}


@pytest.mark.parametrize(
    ("env", "place"),
    [
        # torchrun, mpirun wrappers: their own variables win, SLURM's included
        (
            {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_TASKS_PER_NODE": "1"},
            {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        ),
        (
            {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "5", "GROUP_WORLD_SIZE": "6", **_SLURM},
            {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "5", "GROUP_WORLD_SIZE": "6"},
        ),
        # a launcher's LOCAL_RANK without its size: SLURM's size (4) is no bound of that rank
        ({"LOCAL_RANK": "5", **_SLURM}, {"LOCAL_RANK": "5"}),
        # srun: the task's place on its node
        (_SLURM, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}),
        ({"SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"}, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}),
        # one process: nothing known, the one-rank node's 0 and 1 stay
        ({}, {}),
    ],
)  # fmt: skip
def test_the_child_keeps_the_launchers_local_rank_and_local_world_size(env, place) -> None:
    assert launcher_place(env) == place
