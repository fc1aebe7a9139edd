"""nvrx.slurm.topology: the job's topology, as the contract's ``JobEnv``, from SLURM's environment."""

from __future__ import annotations

import pytest

from nvrx.jobenv import PORT_STRIDE, JobEnv
from nvrx.slurm.topology import (
    PORT_BASE,
    PORT_SLOTS,
    job_from_slurm,
    ports_for_job,
    tasks_on_this_node,
)


def _step_env(**extra: str) -> dict[str, str]:
    """Environment of one task of ``srun --ntasks-per-node=1`` in a 3-node job."""
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NODELIST": "gpu[01-03]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu[01-03]",
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_PROCID": "2",
        "SLURM_NODEID": "2",
    }
    env.update(extra)
    return env


def test_from_slurm_step_env(tmp_path) -> None:
    job = job_from_slurm(_step_env(), nproc_per_node=4, log_dir=str(tmp_path))
    master, store = ports_for_job("1234")
    assert job == JobEnv(job_id="1234", log_dir=str(tmp_path), nnodes=3, node_rank=2,
                         nproc_per_node=4, master_addr="gpu01", master_port=master,
                         store_port=store)  # fmt: skip


def test_nvrx_job_id_and_log_dir_come_from_the_contract() -> None:
    job = job_from_slurm(_step_env(NVRX_JOB_ID="mine", NVRX_LOG_DIR="/logs"))
    assert (job.job_id, job.log_dir, job.nproc_per_node) == ("mine", "/logs", 1)
    assert (job.master_port, job.store_port) == ports_for_job("1234")  # still SLURM's job


def test_node_rank_is_procid_with_one_task_per_node() -> None:
    # block distribution makes PROCID and NODEID agree; a different PROCID proves which is read
    env = _step_env(SLURM_PROCID="1", SLURM_NODEID="0")
    assert job_from_slurm(env).node_rank == 1


def test_node_rank_is_nodeid_with_several_tasks_per_node() -> None:
    env = _step_env(SLURM_STEP_NUM_TASKS="6", SLURM_PROCID="5", SLURM_NODEID="2")
    assert job_from_slurm(env).node_rank == 2


def test_batch_shell_uses_job_nodelist_and_nodeid() -> None:
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "0",
    }
    job = job_from_slurm(env)
    assert (job.nnodes, job.node_rank, job.master_addr) == (2, 1, "node1")


def test_step_on_part_of_the_job_uses_step_nodelist() -> None:
    env = _step_env(
        SLURM_STEP_NODELIST="gpu03",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NUM_TASKS="1",
        SLURM_PROCID="0",
        SLURM_NODEID="0",
    )
    job = job_from_slurm(env)
    assert (job.nnodes, job.node_rank, job.master_addr) == (1, 0, "gpu03")


def test_explicit_ports_win() -> None:
    job = job_from_slurm(_step_env(MASTER_PORT="29500", NVRX_STORE_PORT="29600"))
    assert (job.master_port, job.store_port) == (29500, 29600)


def test_only_master_port_given_keeps_ports_distinct() -> None:
    derived_store = ports_for_job("1234")[1]
    job = job_from_slurm(_step_env(MASTER_PORT=str(derived_store)))
    assert job.master_port == derived_store
    assert job.store_port != job.master_port


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"SLURM_JOB_ID": "12x"}, "SLURM_JOB_ID='12x'"),
        ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID=''"),
        ({"SLURM_PROCID": "three"}, "SLURM_PROCID='three'"),
        ({"SLURM_PROCID": "3"}, "SLURM_PROCID=3"),
        ({"SLURM_STEP_NUM_NODES": "4"}, "SLURM_STEP_NUM_NODES=4"),
        ({"SLURM_STEP_NODELIST": "gpu[03-01]"}, "SLURM_STEP_NODELIST='gpu[03-01]'"),
        ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"NVRX_STORE_PORT": "x"}, "NVRX_STORE_PORT='x'"),
        ({"MASTER_PORT": "5000", "NVRX_STORE_PORT": "5000"}, "both 5000"),
    ],
)
def test_bad_values_name_the_variable(override: dict[str, str], needle: str) -> None:
    env = _step_env(**override)
    if override.get("SLURM_STEP_NODELIST") == "":
        env.pop("SLURM_JOB_NODELIST")
    with pytest.raises(ValueError) as info:
        job_from_slurm(env)
    assert needle in str(info.value)


def test_ports_are_in_range_and_differ_for_neighbouring_jobs() -> None:
    seen = set()
    for job in range(1000, 1000 + PORT_SLOTS):
        master, store = ports_for_job(str(job))
        assert PORT_BASE <= master < store < PORT_BASE + PORT_STRIDE * PORT_SLOTS
        seen.update((master, store))
    assert len(seen) == 2 * PORT_SLOTS  # no two of PORT_SLOTS consecutive jobs share a port


@pytest.mark.parametrize(
    ("extra", "tasks"),
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_TASKS_PER_NODE": "8(x3)"}, 3),
        ({"SLURM_TASKS_PER_NODE": "2,5,1"}, 1),
        ({"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS_PER_NODE": "2"}, 2),  # node 2 not in it
        ({"SLURM_TASKS_PER_NODE": "2(x", "SLURM_NTASKS_PER_NODE": "6"}, 6),
        ({"SLURM_NTASKS_PER_NODE": "6"}, 6),
        ({}, None),
        ({"SLURM_NTASKS_PER_NODE": "many"}, None),
    ],
)
def test_tasks_on_this_node_read_slurms_compact_counts_at_this_node(
    extra: dict[str, str], tasks: int | None
) -> None:
    assert tasks_on_this_node(_step_env(**extra)) == tasks  # SLURM_NODEID=2


def test_an_error_names_the_node_list_variable_that_was_read() -> None:
    """Only SLURM_NODELIST set (no step list): its bad value is named, not the one unset."""
    env = _step_env()
    env.pop("SLURM_STEP_NODELIST")
    env.pop("SLURM_JOB_NODELIST", None)
    env["SLURM_NODELIST"] = "n[1-"
    with pytest.raises(ValueError, match=r"^SLURM_NODELIST='n\[1-'"):
        job_from_slurm(env)


def test_nvrx_srun_names_the_node_count_variable_that_was_read() -> None:
    from nvrx.slurm.srun_cli import UsageError, node_count

    with pytest.raises(UsageError, match="^SLURM_NNODES must be a number of nodes, got 'x'"):
        node_count({"SLURM_NNODES": "x"})
    with pytest.raises(UsageError, match="^SLURM_JOB_NUM_NODES must be"):
        node_count({"SLURM_JOB_NUM_NODES": "0x", "SLURM_NNODES": "2"})
