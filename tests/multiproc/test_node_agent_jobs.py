"""A node agent without a supervisor serves one job, and ends with it: a job started
again at the store address of one that was just killed (a fixed ``MASTER_PORT``) gets an
agent of its own, and the killed job's agent, which its store's return would otherwise
keep serving the new job with the old job's configuration, ends; a job killed before its
first round formed, whose store outlives it, leaves no agent behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers_inprocess import Ranks, free_port_pair, rank_env
from helpers_wrapper_paths import HERE, ROOT, launch, node_agents
from test_wrapper import FAST

from nvrx import jobenv
from nvrx.node_agent.host import NO_ROUND_S
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


def _entered(tmp: Path, count: int) -> bool:
    return len(list(tmp.glob("entered-0-*"))) == count


def _kill_ranks(ranks: Ranks, agent: psutil.Process) -> None:
    """SIGKILL every process of the ranks' trees but the agent (in a session of its own, as
    a job's cgroup kill that spares it: a launcher's kill of its workers)."""
    for proc in ranks.procs:
        rank = psutil.Process(proc.pid)
        for member in [rank, *rank.children(recursive=True)]:
            if member.pid != agent.pid:
                member.kill()
    ranks.wait(30)


def _serve(port: int, served: list) -> bool:
    """Serve a store at ``port`` into ``served``; False while the killed job's connections
    there still close (the server's port is not free yet)."""
    from torch.distributed import DistNetworkError, TCPStore

    try:
        served.append(TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))
    except DistNetworkError:
        return False
    return True


def test_a_job_started_where_a_killed_job_ran_gets_an_agent_of_its_own(tmp_path: Path) -> None:
    """The second job's store is served at the first one's address as soon as the first is
    killed, its token written at once (as its first monitor would; the second job's monitors
    find it there, ``tcp_store_host_rank`` -1): so the killed job's agent, which waits
    ``host_s`` for its store, reaches the new one while it still waits, and must end there
    because of the token, not because its store stayed away."""
    from torch.distributed import TCPStore

    from nvrx.store import host_ring

    logged = dict(FAST, monitor_process_logfile=str(tmp_path / "first" / "monitor-{rank}.log"))
    first = launch(tmp_path / "first", 2, wrapper=logged, scenario="no_hang_protection",
                   fault_ranks=[0, 1], block_s=120, hosts=["a", "a"])  # fmt: skip
    second = store = None
    try:
        wait_until("the first job's ranks in their function", lambda: _entered(tmp_path / "first", 2), 60)
        wait_until("its node agent", lambda: len(node_agents(tmp_path / "first" / "logs")) == 1, 60)
        [old] = node_agents(tmp_path / "first" / "logs")
        _kill_ranks(first, old)
        served: list[TCPStore] = []
        wait_until("the second job's store at the first one's address",
                   lambda: _serve(first.port + 1, served), 30)  # fmt: skip
        store = served[0]
        token = host_ring.job_token(store)
        assert old.is_running()
        apart = dict(FAST, store_kwargs={"tcp_store_host_rank": -1})
        second = launch(tmp_path / "second", 1, wrapper=apart, scenario="no_hang_protection",
                        fault_ranks=[0], block_s=15, hosts=["a"], port=first.port)  # fmt: skip
        assert psutil.wait_procs([old], timeout=30)[1] == [], "the killed job's agent serves on"
        said = " ".join(f.read_text() for f in (tmp_path / "first").glob("monitor-*.log"))
        assert f"holds another job's token {token}: this job is gone" in said, said
        wait_until("the second job's rank in its function", lambda: _entered(tmp_path / "second", 1), 60)
        new_agent = lambda: len(node_agents(tmp_path / "second" / "logs")) == 1  # noqa: E731
        wait_until("the second job's own node agent", new_agent, 30)
        assert second.wait(120) == [0], second.logs()
    finally:
        first.kill()
        if second is not None:
            second.kill()
        for logs in ("first", "second"):
            for agent in node_agents(tmp_path / logs / "logs"):
                agent.kill()
        del store


def test_an_agent_whose_ranks_died_before_the_first_round_ends_though_the_store_lives(
    tmp_path: Path,
) -> None:
    """Rank 0 of a job of two, rank 1 never started: no round forms. The job is killed; its
    store, served apart (``tcp_store_host_rank`` -1), lives on."""
    from torch.distributed import TCPStore

    from nvrx.store import rounds

    port = free_port_pair()
    store = TCPStore("127.0.0.1", port + 1, is_master=True, wait_for_workers=False)
    wrapper = dict(FAST, store_kwargs={"tcp_store_host_rank": -1})
    (tmp_path / "params.json").write_text(json.dumps({"wrapper": wrapper}))
    ranks = Ranks(tmp_path, port=port, world_size=2)
    env = rank_env(tmp_path / "logs", 0, 2, port)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env[jobenv.HOST_ID] = "a"
    with open(tmp_path / "rank-0.log", "ab") as out:
        ranks.procs.append(subprocess.Popen([sys.executable, str(HERE), str(tmp_path)], env=env,
                                            stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True))  # fmt: skip
    try:
        wait_until("its node agent", lambda: len(node_agents(tmp_path / "logs")) == 1, 60)
        [agent] = node_agents(tmp_path / "logs")
        _kill_ranks(ranks, agent)
        assert rounds.current_round(store) is None  # killed before any round formed
        bound = NO_ROUND_S + 3 * FAST["heartbeat_timeout"] + 30
        assert psutil.wait_procs([agent], timeout=bound)[1] == [], "the agent outlived its job"
    finally:
        ranks.kill()
        for agent in node_agents(tmp_path / "logs"):
            agent.kill()
