"""The supervisor's parts: each is built with the supervisor as its ``NodeControl`` and shares
one job store, one course and one set of local ranks, so that every part sees a failover or a
stop at once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.course import Course
from nvrx.supervisor.node_control import NodeControl
from nvrx.supervisor.supervisor import Supervisor


def _supervisor(tmp_path: Path) -> Supervisor:
    job = local_job(nproc_per_node=2, log_dir=str(tmp_path))
    return Supervisor(SupervisorConfig(command=["train"], job=job))


def test_the_supervisor_is_what_its_parts_ask_for(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    assert isinstance(sup, NodeControl)
    parts = [sup.workload, sup.job_restart, sup.messages, sup.failover, sup.hang_watch,
             sup.restart_standby, sup.job_end]  # fmt: skip
    assert all(part.control is sup for part in parts)
    assert all(part.store is sup.store for part in parts)
    assert all(part.course is sup.course for part in parts if hasattr(part, "course"))
    assert all(part.ranks is sup.ranks for part in parts if hasattr(part, "ranks"))


def test_a_new_store_address_is_the_configuration_of_every_part(tmp_path: Path) -> None:
    """A failover replaces the configuration once, in the job store: the supervisor and its parts see it."""
    sup = _supervisor(tmp_path)
    moved = replace(sup.config, job=replace(sup.config.job, store_port=41000))
    sup.store.config = moved
    assert sup.config is moved and sup.failover.store.config.store_port == 41000


def test_a_stop_moves_the_course_once_and_starts_nothing_more(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    sup.course.to(Course.TRAINING)
    sup.request_stop("test", 1, broadcast=False)
    sup.request_stop("again", 2, broadcast=False)  # a second request changes nothing
    assert sup.course.state is Course.STOPPING
    assert (sup.stop_reason, sup.exit_code) == ("test", 1)
    sup.start_child(0)
    assert sup.ranks.children == {}
