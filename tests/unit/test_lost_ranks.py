"""What a supervisor does with a silent rank: take it out of the running round only where
that round names it (a real TCPStore, the ``base`` fixture), and restart it alone."""

from __future__ import annotations

import json

from nvrx.inprocess import store as rstore
from nvrx.store import rounds
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.job_restart import job_wide


def test_a_silent_rank_waiting_to_be_admitted_does_not_take_out_the_rank_of_its_number(
    base,
) -> None:
    """Round 5 runs without initial rank 0 (a replacement still waiting to be admitted) and
    the ranks were shifted: initial rank 1 is rank 0 there. Initial rank 0's silence must not
    take out rank 0, a healthy process; initial rank 1's does."""
    store = base
    rounds.publish_round(store, 5)
    view = rstore.round_store(store, 5)
    view.set(rounds.rank_state(0), json.dumps({"initial_rank": 1, "world_size": 2}))
    view.set(rounds.rank_state(1), json.dumps({"initial_rank": 2, "world_size": 2}))
    assert not rounds.leave_silent(store, 0, 3, "no heartbeat for 10.0 s")
    assert rstore.terminated_ranks(view) == set()
    assert rounds.leave_silent(store, 1, 3, "no heartbeat for 10.0 s")
    assert rstore.terminated_ranks(view) == {0}


def test_a_process_whose_monitor_beat_is_a_wrapper_rank_before_it_wrote_any_event(tmp_path):
    """Under ``--ft-restart-policy auto`` a Wrapper rank restarts alone: one that waited to be
    admitted (no Wrapper event yet) counts as one when its monitor beat."""
    wrapper_pids = {4242}  # the node agent told of its monitor's beat (``wrapper_pid``)
    job = local_job(log_dir=str(tmp_path))
    config = SupervisorConfig(command=["train"], job=job, ft_restart_policy="auto")
    assert not job_wide(config, wrapper_pids, 4242)
    assert job_wide(config, wrapper_pids, 4343)  # a plain script's process
