"""Fixtures of the SLURM tier: one real local cluster per test session.

``slurm_cluster`` (session scope) is a started ``LocalSlurmCluster``:

- ``.nodes`` (``["node1", "node2"]``), ``.partition`` (``debug``, default),
  ``.high_partition`` (``high``, preempts ``debug``), ``.cpus_per_node`` (4);
- ``.env``: environment for subprocesses that call SLURM commands;
- ``.run(cmd, timeout=60, check=True)``: run ``srun``/``scontrol``/... (a str runs under bash);
- ``.sbatch(script_text_or_path, *sbatch_args, cwd=None) -> job id``;
- ``.wait_job(job_id, states=TERMINAL_STATES, timeout=60) -> state``,
  ``.job_state(job_id)``, ``.job_info(job_id)`` (scontrol fields);
- ``.sacct(job_id) -> rows`` (waits until accounting caught up);
- ``.requeue(job_id)``: ``scontrol requeue``, and the job starts again ~2 s later;
- ``.crash_node(name)`` / ``.revive_node(name)``, ``.freeze_node`` / ``.thaw_node``.

Jobs run on this machine's filesystem as root; use ``sys.executable`` as the
Python of a job. Every test using ``slurm_cluster`` gets, afterwards, a cluster
with no jobs and every node up (``reset``), so tests do not see each other's jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.support.slurm_cluster import ClusterUnavailable, LocalSlurmCluster

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def _slurm_cluster_session() -> Iterator[LocalSlurmCluster]:
    try:
        LocalSlurmCluster.check_can_run()
    except ClusterUnavailable as err:
        pytest.skip(f"needs root and apt-get to install SLURM: {err}")
    cluster = LocalSlurmCluster(nodes=4)  # node-loss tests need spares and nodes to requeue onto
    try:
        cluster.start()
    except ClusterUnavailable as err:
        pytest.skip(f"needs root and apt-get to install SLURM: {err}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm_cluster(_slurm_cluster_session: LocalSlurmCluster) -> Iterator[LocalSlurmCluster]:
    """The session's cluster; after the test, leftover jobs are cancelled and nodes restored."""
    yield _slurm_cluster_session
    leftovers = _slurm_cluster_session.reset()
    if leftovers:
        logger.info("cancelled jobs left by the test: %s", leftovers)
