"""nvrx.slurm.topology: the job's shape from SLURM's environment or for local runs."""

from __future__ import annotations

import dataclasses

import pytest

from nvrx.slurm.topology import PORT_BASE, PORT_SLOTS, Topology, ports_for_job


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


def test_from_slurm_step_env() -> None:
    topo = Topology.from_env(_step_env(SLURM_RESTART_COUNT="2"))
    assert topo.is_slurm
    assert topo.job_id == "1234" and topo.step_id == "0"
    assert topo.node_rank == 2 and topo.nnodes == 3
    assert topo.nodelist == ("gpu01", "gpu02", "gpu03")
    assert topo.master_addr == "gpu01"
    assert topo.node_name == "gpu03"
    assert (topo.master_port, topo.store_port) == ports_for_job("1234")
    assert topo.restart_count == 2


def test_node_rank_is_procid_with_one_task_per_node() -> None:
    # block distribution makes PROCID and NODEID agree; a different PROCID proves which is read
    env = _step_env(SLURM_PROCID="1", SLURM_NODEID="0")
    assert Topology.from_env(env).node_rank == 1


def test_node_rank_is_nodeid_with_several_tasks_per_node() -> None:
    env = _step_env(SLURM_STEP_NUM_TASKS="6", SLURM_PROCID="5", SLURM_NODEID="2")
    assert Topology.from_env(env).node_rank == 2


def test_batch_shell_uses_job_nodelist_and_nodeid() -> None:
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
    }
    topo = Topology.from_env(env)
    assert topo.step_id is None and topo.nnodes == 2 and topo.node_rank == 0
    assert topo.nodelist == ("node1", "node2") and topo.restart_count == 0


def test_step_on_part_of_the_job_uses_step_nodelist() -> None:
    env = _step_env(
        SLURM_STEP_NODELIST="gpu03",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NUM_TASKS="1",
        SLURM_PROCID="0",
        SLURM_NODEID="0",
    )
    topo = Topology.from_env(env)
    assert topo.nodelist == ("gpu03",) and topo.master_addr == "gpu03"


def test_explicit_ports_win() -> None:
    topo = Topology.from_env(_step_env(MASTER_PORT="29500", NVRX_STORE_PORT="29600"))
    assert (topo.master_port, topo.store_port) == (29500, 29600)


def test_only_master_port_given_keeps_ports_distinct() -> None:
    derived_store = ports_for_job("1234")[1]
    topo = Topology.from_env(_step_env(MASTER_PORT=str(derived_store)))
    assert topo.master_port == derived_store
    assert topo.store_port != topo.master_port


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"SLURM_JOB_ID": "12x"}, "SLURM_JOB_ID='12x'"),
        ({"SLURM_PROCID": "three"}, "SLURM_PROCID='three'"),
        ({"SLURM_PROCID": "3"}, "SLURM_PROCID=3"),
        ({"SLURM_STEP_NUM_NODES": "4"}, "SLURM_STEP_NUM_NODES=4"),
        ({"SLURM_STEP_NODELIST": "gpu[03-01]"}, "SLURM_STEP_NODELIST='gpu[03-01]'"),
        ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST"),
        ({"SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT=-1"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"NVRX_STORE_PORT": "x"}, "NVRX_STORE_PORT='x'"),
    ],
)
def test_bad_values_name_the_variable(override: dict[str, str], needle: str) -> None:
    env = _step_env(**override)
    if override.get("SLURM_STEP_NODELIST") == "":
        env.pop("SLURM_JOB_NODELIST")
    with pytest.raises(ValueError) as info:
        Topology.from_env(env)
    assert needle in str(info.value)


def test_ports_are_in_range_and_differ_for_neighbouring_jobs() -> None:
    seen = set()
    for job in range(1000, 1000 + PORT_SLOTS):
        master, store = ports_for_job(str(job))
        assert PORT_BASE <= master < store < PORT_BASE + 2 * PORT_SLOTS
        seen.update((master, store))
    assert len(seen) == 2 * PORT_SLOTS  # no two of PORT_SLOTS consecutive jobs share a port


def test_local_topology() -> None:
    topo = Topology.local(nnodes=3, node_rank=1, job_id="local-abc")
    assert not topo.is_slurm
    assert topo.nodelist == ("127.0.0.1",) * 3 and topo.master_addr == "127.0.0.1"
    assert (topo.master_port, topo.store_port) == ports_for_job("local-abc")
    assert topo.restart_count == 0 and topo.step_id is None
    assert Topology.local(2, 0).job_id.startswith("local-")


def test_local_explicit_ports_and_validation() -> None:
    topo = Topology.local(2, 0, master_addr="10.0.0.5", master_port=12345, store_port=12346)
    assert (topo.master_addr, topo.master_port, topo.store_port) == ("10.0.0.5", 12345, 12346)
    with pytest.raises(ValueError, match="node_rank=2"):
        Topology.local(2, 2)
    with pytest.raises(ValueError, match="nnodes=0"):
        Topology.local(0, 0)
    with pytest.raises(ValueError, match="both 5000"):
        Topology.local(1, 0, master_port=5000, store_port=5000)


def test_from_env_without_slurm_reads_the_nvrx_contract() -> None:
    env = {
        "NVRX_JOB_ID": "local-7",
        "NVRX_NNODES": "2",
        "NVRX_NODE_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "23456",
        "NVRX_STORE_PORT": "23457",
    }
    topo = Topology.from_env(env)
    assert (topo.is_slurm, topo.job_id, topo.nnodes, topo.node_rank) == (False, "local-7", 2, 1)
    assert (topo.master_port, topo.store_port) == (23456, 23457)
    assert Topology.from_env({}).nnodes == 1
    with pytest.raises(ValueError, match="NVRX_NODE_RANK='a'"):
        Topology.from_env({"NVRX_NODE_RANK": "a"})


def test_topology_is_frozen() -> None:
    topo = Topology.local(1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.node_rank = 1  # type: ignore[misc]
