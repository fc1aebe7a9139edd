"""The job client of the local test cluster: run SLURM commands, submit
batch jobs, read and wait for their state, requeue, read accounting, cancel,
and reset the cluster between tests.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from nvrx.slurm import commands
from nvrx.slurm.commands import TERMINAL_STATES
from tests.support.slurm_daemons import is_ours
from tests.support.slurm_errors import ClusterError, wait_for

#: Job states slurmctld never moves a job out of (PREEMPTED and NODE_FAIL may be requeued).
_FINAL_STATES = TERMINAL_STATES - {"PREEMPTED", "NODE_FAIL"}


class JobClient:
    """Mixin of ``LocalSlurmCluster``: what tests do with jobs.

    Uses ``nodes``, ``env``, ``jobs_dir``, ``log_dir``, ``use_freezer``,
    ``_records``, ``_script_counter``, ``thaw_node``, ``_start_slurmd``,
    ``node_states`` and ``wait_nodes_usable``.
    """

    def run(
        self,
        cmd: Sequence[str] | str,
        timeout: float = 60,
        check: bool = True,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command (a str runs under ``bash -c``) with ``self.env``; text output.

        ``check`` raises SlurmCommandError on a non-zero exit; a timeout always raises.
        """
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return commands.run_command(
            argv, timeout=timeout, env=self.env, check=check, cwd=cwd or self.jobs_dir
        )

    def sbatch(
        self,
        script: str | os.PathLike[str],
        *args: str,
        cwd: Path | None = None,
        script_args: Sequence[str] = (),
    ) -> int:
        """Submit a batch job; return its id.

        ``script`` is a path (``pathlib.Path``) or the script's text (a ``str``;
        ``#!/bin/bash`` is added when it has no ``#!`` line). ``args`` go to
        sbatch before the script (``"-N2"``, ``"-o", "out-%j.txt"``...). The
        job's working directory is ``cwd`` (default ``jobs_dir``); ``script_args`` go
        to the script.
        """
        cwd = Path(cwd or self.jobs_dir)
        if isinstance(script, str):
            text = script if script.startswith("#!") else "#!/bin/bash\n" + script
            self._script_counter += 1
            path = self.jobs_dir / f"script-{os.getpid()}-{self._script_counter}.sh"
            path.write_text(text)
            path.chmod(0o755)
        else:
            path = Path(script)
        done = self.run(
            ["sbatch", "--parsable", *args, str(path), *script_args], cwd=cwd, timeout=30
        )
        job = done.stdout.strip().split(";")[0]
        if not job.isdigit():
            raise ClusterError(f"sbatch printed {done.stdout!r}, not a job id")
        return int(job)

    def job_state(self, job_id: int) -> str | None:
        """Current state of a job (``PENDING``, ``RUNNING``, ``COMPLETED``...)."""
        return commands.job_state(job_id, env=self.env)

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` fields of a job; ClusterError when slurmctld does not know it."""
        info = commands.show_job(job_id, env=self.env)
        if info is None:
            raise ClusterError(f"slurmctld does not know job {job_id}")
        return info

    def wait_job(
        self,
        job_id: int,
        states: Iterable[str] = TERMINAL_STATES,
        timeout: float = 60,
        fail_fast: bool = True,
    ) -> str:
        """Wait until a job reaches one of ``states`` (default: any end state); return it.

        With ``fail_fast``, a job that ends in a state it cannot leave
        (``COMPLETED``, ``FAILED``, ``CANCELLED``...; not ``PREEMPTED`` or
        ``NODE_FAIL``, which a requeue follows) raises at once.
        """
        wanted = set(states)
        seen: list[str | None] = [None]

        def reached() -> bool:
            seen[0] = self.job_state(job_id)
            if fail_fast and seen[0] in _FINAL_STATES and seen[0] not in wanted:
                raise ClusterError(
                    f"job {job_id} ended {seen[0]} while waiting for {sorted(wanted)}; "
                    f"see {self.log_dir}/slurmctld.log"
                )
            return seen[0] in wanted

        try:
            wait_for(f"job {job_id} to reach {sorted(wanted)}", reached, timeout)
        except ClusterError as err:
            raise ClusterError(f"{err}; its state is {seen[0]}") from None
        return str(seen[0])

    def requeue(self, job_id: int, timeout: float = 30) -> None:
        """``scontrol requeue`` a job, then let it start again within seconds.

        A requeued job may not start for cred_expire (10 s). Starting it earlier
        is allowed, but a launch in the same second as the end of the previous
        run finds the job's credential revoked and the job FAILS; so the new
        start time is 2 s after the job is pending again.
        """
        self.run(["scontrol", "requeue", str(job_id)])
        self.start_soon_when_requeued(job_id, timeout)

    def start_soon_when_requeued(
        self, job_id: int, timeout: float = 30, time_limit_min: int | None = None
    ) -> None:
        """Once a requeued job (by anyone) is pending again, let it start 2 s later
        instead of after cred_expire; never in the same second (see ``requeue``).

        ``time_limit_min``: the next run's time limit, so that a run that must finish
        is not warned again however slowly this machine starts it.
        """
        self.wait_job(job_id, {"PENDING"}, timeout=timeout)
        limit = [] if time_limit_min is None else [f"TimeLimit={time_limit_min}"]
        self.run(["scontrol", "update", f"jobid={job_id}", *limit, "StartTime=now+2"], check=False)

    def sacct(self, job_id: int, timeout: float = 15, **kwargs) -> list[dict[str, str]]:
        """sacct rows of a job (all runs, steps included), once accounting caught up.

        Accounting lags slurmctld by about a second: this waits until the job's
        own row shows the state slurmctld reports. ``kwargs`` go to
        ``nvrx.slurm.commands.sacct_rows`` (``fields``, ``all_runs``).
        """
        rows: list[dict[str, str]] = []

        def caught_up() -> bool:
            rows[:] = commands.sacct_rows(job_id, env=self.env, **kwargs)
            info = commands.show_job(job_id, env=self.env)
            main = [r for r in rows if r.get("JobID") == str(job_id)]
            if not main:
                return False
            if info is None or "State" not in main[-1]:
                return True
            return main[-1]["State"].split()[0] == info.get("JobState")

        wait_for(f"accounting of job {job_id}", caught_up, timeout)
        return rows

    def cancel_all(self, timeout: float = 30) -> list[int]:
        """Cancel every job and wait until slurmctld has none left; return their ids."""
        jobs = commands.queued_job_ids(env=self.env)
        if jobs:
            commands.cancel(jobs, env=self.env)
            wait_for(
                "cancelled jobs to end", lambda: not commands.queued_job_ids(env=self.env), timeout
            )
        return jobs

    def reset(self, timeout: float = 60) -> list[int]:
        """Back to a clean cluster between tests: cancel jobs, revive or resume every node.

        Returns the ids of the jobs that had to be cancelled.
        """
        jobs = self.cancel_all(timeout=timeout)
        for node in self.nodes:
            if self.use_freezer:
                self.thaw_node(node)
            name = f"slurmd-{node}"
            if name not in self._records or not is_ours(self._records[name]):
                self._start_slurmd(node)
        states = self.node_states()
        bad = [
            n
            for n in self.nodes
            if states.get(n, "").rstrip("*~#") in ("down", "drained", "draining", "fail")
        ]
        if bad:
            # A restarted slurmd may have brought its node back meanwhile, and resuming a node
            # that is up fails: the wait below tells whether every node is usable.
            self.run(
                ["scontrol", "update", f"nodename={','.join(bad)}", "state=resume"], check=False
            )
        self.wait_nodes_usable(self.nodes, timeout=timeout)
        return jobs
