"""The tests' free ports never lie where nvrx derives a job's ports from its id: a job of
the local SLURM cluster (or a supervisor started without ports) binds those later, and a
test that held one then made that job fail with EADDRINUSE."""

from __future__ import annotations

from nvrx import jobenv
from tests.support.ports import DERIVED, LOWEST, _ephemeral_start, free_port_run, free_ports


def test_no_pick_lies_in_the_range_of_ports_derived_from_job_ids() -> None:
    derived = {p for job in range(1, 200) for p in jobenv.ports_for_job(str(job))}
    assert derived <= set(DERIVED)
    top = _ephemeral_start()
    for n in (1, 2, 4):
        for _ in range(300):
            port = free_port_run(n)
            run = set(range(port, port + n))
            assert not run & set(DERIVED), (n, port)
            assert LOWEST <= port and port + n <= top, (n, port)
    assert not set(free_ports(50)) & set(DERIVED)
