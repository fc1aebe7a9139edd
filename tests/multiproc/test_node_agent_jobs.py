"""A node agent without a supervisor serves one job: a job started again at the store
address of one that was just killed (a fixed ``MASTER_PORT``) gets an agent of its own,
and the killed job's agent, which its store's return would otherwise keep serving the
new job with the old job's configuration, ends."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from helpers_wrapper_paths import launch, node_agents
from test_wrapper import FAST

from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


def _entered(tmp: Path, count: int) -> bool:
    return len(list(tmp.glob("entered-0-*"))) == count


def test_a_job_started_where_a_killed_job_ran_gets_an_agent_of_its_own(tmp_path: Path) -> None:
    first = launch(tmp_path / "first", 2, wrapper=FAST, scenario="no_hang_protection",
                   fault_ranks=[0, 1], block_s=120, hosts=["a", "a"])  # fmt: skip
    second = None
    try:
        wait_until("the first job's ranks in their function", lambda: _entered(tmp_path / "first", 2), 60)
        wait_until("its node agent", lambda: len(node_agents(tmp_path / "first" / "logs")) == 1, 60)
        [old] = node_agents(tmp_path / "first" / "logs")
        for proc in first.procs:  # the job is killed; its agent, in a session of its own, is not
            rank = psutil.Process(proc.pid)
            for member in [rank, *rank.children(recursive=True)]:
                if member.pid != old.pid:
                    member.kill()
        first.wait(30)
        assert old.is_running()
        second = launch(tmp_path / "second", 1, wrapper=FAST, scenario="no_hang_protection",
                        fault_ranks=[0], block_s=15, hosts=["a"], port=first.port)  # fmt: skip
        wait_until("the second job's rank in its function", lambda: _entered(tmp_path / "second", 1), 60)
        new_agent = lambda: len(node_agents(tmp_path / "second" / "logs")) == 1  # noqa: E731
        wait_until("the second job's own node agent", new_agent, 30)
        assert psutil.wait_procs([old], timeout=30)[1] == [], "the killed job's agent serves on"
        assert second.wait(120) == [0], second.logs()
    finally:
        first.kill()
        if second is not None:
            second.kill()
        for logs in ("first", "second"):
            for agent in node_agents(tmp_path / logs / "logs"):
                agent.kill()
