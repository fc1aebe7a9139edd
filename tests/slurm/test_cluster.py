"""The local cluster fixture itself: placement, exit states, requeue, signals, accounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.slurm_cluster import LocalSlurmCluster, pid_alive
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def test_srun_spreads_four_tasks_over_both_nodes(slurm_cluster: LocalSlurmCluster) -> None:
    done = slurm_cluster.run(
        ["srun", "-N2", "-n4", "bash", "-c", "echo $SLURM_PROCID $SLURMD_NODENAME"], timeout=60
    )
    rows = sorted(line.split() for line in done.stdout.splitlines())
    assert [int(rank) for rank, _ in rows] == [0, 1, 2, 3]
    assert {node for _, node in rows} == set(slurm_cluster.nodes[:2])  # -N2: the first two


def test_sbatch_wait_completes_and_sacct_agrees(slurm_cluster: LocalSlurmCluster, tmp_path) -> None:
    out = tmp_path / "out.txt"
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsrun --ntasks-per-node=1 bash -c 'echo $SLURM_NODEID'\n")
    # sbatch --wait looks at the job less and less often (2 s, then 8 s, then 32 s later): a
    # job not ended by its second look, on a loaded machine, returns past half a minute
    done = slurm_cluster.run(
        ["sbatch", "--parsable", "--wait", "-N2", "-o", str(out), str(script)], timeout=120
    )
    job = int(done.stdout.strip().split(";")[0])
    # it returns once the job ended, while its nodes may still clean up (COMPLETING)
    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED"
    assert sorted(out.read_text().split()) == ["0", "1"]
    rows = slurm_cluster.sacct(job)
    main = [r for r in rows if r["JobID"] == str(job)]
    assert [r["State"] for r in main] == ["COMPLETED"]
    assert main[0]["ExitCode"] == "0:0"
    assert f"{job}.0" in {r["JobID"] for r in rows}  # the srun step is accounted too


def test_scancel_gives_cancelled(slurm_cluster: LocalSlurmCluster) -> None:
    job = slurm_cluster.sbatch("sleep 300\n", "-o", "/dev/null")
    slurm_cluster.wait_job(job, {"RUNNING"}, timeout=30)
    slurm_cluster.run(["scancel", str(job)])
    assert slurm_cluster.wait_job(job, timeout=30) == "CANCELLED"
    main = [r for r in slurm_cluster.sacct(job) if r["JobID"] == str(job)]
    assert main[-1]["State"].startswith("CANCELLED")


def test_one_task_fails_while_the_others_finish(slurm_cluster: LocalSlurmCluster) -> None:
    script = '[ "$SLURM_PROCID" = 1 ] && exit 3; sleep 1; echo "finished $SLURM_PROCID"'
    done = slurm_cluster.run(
        ["srun", "-N2", "-n3", "--kill-on-bad-exit=0", "bash", "-c", script],
        timeout=60,
        check=False,
    )
    assert done.returncode == 3
    assert sorted(done.stdout.splitlines()) == ["finished 0", "finished 2"]


def test_requeue_runs_again_with_restart_count(slurm_cluster: LocalSlurmCluster, tmp_path) -> None:
    out = tmp_path / "requeue.txt"
    job = slurm_cluster.sbatch(
        'echo "run ${SLURM_RESTART_COUNT:-0}"\nsleep 300\n',
        "--requeue",
        "--open-mode=append",
        "-o",
        str(out),
    )
    slurm_cluster.wait_job(job, {"RUNNING"}, timeout=30)
    slurm_cluster.requeue(job)  # scontrol requeue, then StartTime=now+2
    slurm_cluster.wait_job(job, {"RUNNING"}, timeout=45)
    assert slurm_cluster.job_info(job)["Restarts"] == "1"
    # RUNNING comes before the batch script's first line: its echo is awaited, not assumed
    wait_until("the second run's line", lambda: "run 1" in out.read_text(), 45, state=out.read_text)
    slurm_cluster.run(["scancel", str(job)])
    slurm_cluster.wait_job(job, timeout=30)
    runs_seen = [line for line in out.read_text().splitlines() if line.startswith("run ")]
    assert runs_seen == ["run 0", "run 1"]
    runs = [r["State"] for r in slurm_cluster.sacct(job) if r["JobID"] == str(job)]
    assert runs[0] == "REQUEUED" and runs[-1].startswith("CANCELLED")


def test_signal_reaches_trap_in_batch_script(slurm_cluster: LocalSlurmCluster, tmp_path) -> None:
    out = tmp_path / "signal.txt"
    ready = tmp_path / "trap-set"
    script = (
        f"trap 'echo \"got USR2\"; exit 0' USR2\n"
        f"touch {ready}\n"
        # a background sleep + wait lets bash run the trap as soon as the signal comes
        "sleep 300 & wait $!\n"
        'echo "no signal"\n'
    )
    job = slurm_cluster.sbatch(script, "-o", str(out))
    slurm_cluster.wait_job(job, {"RUNNING"}, timeout=30)
    _wait_file(ready, timeout=30)
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", str(job)])
    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED"
    assert out.read_text().strip() == "got USR2"


def _wait_file(path: Path, timeout: float) -> None:
    """Wait (bounded) until the job creates ``path``: its shell has set the trap."""
    wait_until(f"the job to create {path}", path.exists, timeout, interval=0.05)


def test_crash_node_kills_its_job_processes_and_revive_brings_it_back(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    job = slurm_cluster.sbatch(
        f"sleep 300 &\necho $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\nwait\n",
        "-w",
        "node2",
        "-o",
        "/dev/null",
    )
    slurm_cluster.wait_job(job, {"RUNNING"}, timeout=30)
    _wait_file(pid_file, timeout=30)
    sleep_pid = int(pid_file.read_text())
    assert pid_alive(sleep_pid)
    killed = slurm_cluster.crash_node("node2")
    assert sleep_pid in killed
    assert not pid_alive(sleep_pid)
    assert "slurmd-node2" not in slurm_cluster.status()
    slurm_cluster.revive_node("node2")
    done = slurm_cluster.run(["srun", "-w", "node2", "-n1", "printenv", "SLURMD_NODENAME"])
    assert done.stdout.strip() == "node2"
