"""The tests' free ports never lie where nvrx derives a job's ports from its id, nor on the
local SLURM cluster's slurmd ports: a job of that cluster (or of submitit's local executor)
binds those later, and a test that held one made that job fail with EADDRINUSE."""

from __future__ import annotations

from nvrx import jobenv
from tests.support.ports import (
    DERIVED,
    LOWEST,
    SLURMD,
    _candidates,
    _ephemeral_start,
    free_port_run,
    free_ports,
)
from tests.support.slurm_config import SLURMD_PORT_BASE


def test_every_port_derived_from_a_job_id_lies_in_the_range_never_picked() -> None:
    for slot in range(jobenv.PORT_SLOTS):
        master, store = jobenv.ports_for_job(str(slot))
        block = range(master, master + jobenv.PORT_STRIDE)  # NVRx's layout: +1, +2; the store
        assert store in block and block.start in DERIVED and block[-1] in DERIVED, slot
    assert jobenv.ports_for_job("local-12345")[0] in DERIVED
    assert SLURMD_PORT_BASE + 1 in SLURMD


def test_no_candidate_run_touches_a_job_or_slurmd_port_or_the_ephemeral_range() -> None:
    ephemeral = _ephemeral_start()
    for low, high in [(0, 0), (0, 1), (0, 3)]:
        starts = _candidates(low, high, ephemeral)
        for p in starts:
            run = range(p + low, p + high + 1)
            assert LOWEST <= run.start and run[-1] < ephemeral, (low, high, p)
            assert not any(q in DERIVED or q in SLURMD for q in run), (low, high, p)
        edges = {DERIVED.start - 1 - high, DERIVED.stop, SLURMD.start - 1 - high, SLURMD.stop}
        assert edges <= set(starts), (low, high)  # the ends of what is avoided, no more
        assert DERIVED.start - high not in starts and SLURMD.start - high not in starts


def test_picks_are_candidates_and_free_ports_are_distinct() -> None:
    for n in (1, 2, 4):
        assert free_port_run(n) in _candidates(0, n - 1, _ephemeral_start())
    picked = free_ports(20)
    assert len(set(picked)) == 20 and not set(picked) & (set(DERIVED) | set(SLURMD))
