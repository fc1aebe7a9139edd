"""Preemption and time limits on a real cluster: checkpoint, one requeue from node 0, resume, finish."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest

from nvrx.events import read_dir
from nvrx.slurm import commands
from nvrx.submission.submit import submit
from nvrx.supervisor.warning_cause import parse_duration
from tests.support.fifo import open_for_writing
from tests.support.waiting import wait_until

TEMPLATES = Path(__file__).resolve().parents[2] / "sbatch_templates"


def train_until_warned(ckpt_dir: str, steps_after_resume: int) -> dict:
    """Train until SLURM's warning and checkpoint; once resumed, finish a few steps later."""
    import nvrx

    rank = int(os.environ["RANK"])
    run = os.environ.get("SLURM_RESTART_COUNT", "0")
    path = Path(ckpt_dir) / f"rank{rank}.json"
    start = json.loads(path.read_text())["step"] if path.exists() else 0
    if start:
        nvrx.record_checkpoint(path, start, action="load")
    (Path(ckpt_dir) / f"started-run{run}-rank{rank}").touch()
    step = start
    while not (run != "0" and step >= start + steps_after_resume):
        if nvrx.preemption_requested():
            path.write_text(json.dumps({"step": step}))
            nvrx.record_checkpoint(path, step)
            return {"rank": rank, "stopped_at": step}
        step += 1
        time.sleep(0.05)
    return {"rank": rank, "run": run, "resumed_from": start, "final": step}


def _expected_window(decided: dict, cause: str, grace_time: float) -> float:
    """What docs/submit.md says the window is, from what the deciding node read: the time
    left (a time limit) or the partition's GraceTime (a preemption), less a margin of a
    quarter of it, at most 10 s (these windows are well above the floor of 1 s)."""
    left = grace_time
    if cause == "time_limit":
        left = parse_duration(decided["TimeLimit"]) - parse_duration(decided["RunTime"])
    return left - min(10.0, 0.25 * left)


def _check_resumed(job, ckpt: Path, nranks: int, cause: str, grace_time: float) -> None:
    results = job.results(timeout=120)
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["run"] == "1"  # SLURM_RESTART_COUNT of the run that finished
        assert result["resumed_from"] > 0, result
        assert result["final"] == result["resumed_from"] + 5
    assert all((ckpt / f"started-run0-rank{r}").exists() for r in range(nranks))
    events, _ = read_dir(job.log_dir)
    warnings = [e for e in events if e["kind"] == "preempt_signal"]
    assert {e["node"] for e in warnings} == {0, 1}
    assert {e["cause"] for e in warnings} == {cause}
    decided = [e for e in warnings if e["decided_by"] == "scontrol"]  # the others read its flag
    assert decided, warnings
    for e in decided:
        assert e["window_s"] == pytest.approx(_expected_window(e, cause, grace_time), abs=0.06), e
    requeues = [e for e in events if e["kind"] == "requeue"]
    assert [(e["node"], e["cause"], e["count"]) for e in requeues] == [(0, cause, 1)]
    saves = [e for e in events if e["kind"] == "checkpoint" and e["action"] == "save"]
    assert sorted(e["rank"] for e in saves) == list(range(nranks))
    # every writer recorded the run of the SLURM job it wrote in (SLURM_RESTART_COUNT)
    starts = sorted((e["slurm_run"], e["node"]) for e in events if e["kind"] == "supervisor_start")
    assert starts == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {e["slurm_run"] for e in [*saves, *requeues]} == {0}
    loads = [e for e in events if e["kind"] == "checkpoint" and e["action"] == "load"]
    assert sorted(e["rank"] for e in loads) == list(range(nranks))
    assert {e["slurm_run"] for e in loads} == {1}
    summary = job.report().to_dict()["summary"]
    assert summary["restarts"]["requeue"] == 1
    assert summary["outcome"].startswith("COMPLETED")


@pytest.mark.timeout(240)
def test_preempted_job_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cpus = slurm_cluster.cpus_per_node
    job = submit(
        train_until_warned,
        args=(str(ckpt), 5),
        folder=tmp_path,
        nodes=2,
        nproc_per_node=2,
        timeout_min=10,
        signal_delay_s=60,
        cpus_per_task=cpus,  # the whole cluster: a job of the high partition must preempt it
        slurm_partition=slurm_cluster.partition,
    )
    wait_until("every rank to train", lambda: len(list(ckpt.glob("started-run0-*"))) == 4, 90)
    every_node = f"-N{len(slurm_cluster.nodes)}"  # no free node elsewhere: it must preempt
    high = slurm_cluster.sbatch("sleep 1\n", "-p", slurm_cluster.high_partition, every_node, f"-c{cpus}")
    assert slurm_cluster.wait_job(high, timeout=90) == "COMPLETED"
    slurm_cluster.start_soon_when_requeued(int(job.job_id), 60)
    _check_resumed(job, ckpt, 4, "preemption", slurm_cluster.kill_wait)  # its GraceTime


@pytest.mark.timeout(300)
def test_time_limit_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # 2-minute limit, warning 35 s before it: SLURM may send it up to 60 s early, so between
    # 25 s and 85 s in. Not earlier: a warning sent before the job step's ranks run (on a
    # loaded machine, many seconds after the start) reaches nobody.
    job = submit(
        train_until_warned,
        args=(str(ckpt), 5),
        folder=tmp_path,
        nodes=2,
        nproc_per_node=2,
        timeout_min=2,
        signal_delay_s=35,
        cpus_per_task=1,
    )
    wait_until("every rank to train", lambda: len(list(ckpt.glob("started-run0-*"))) == 4, 90)
    # the resumed run must finish, not be warned again: a longer limit for it
    slurm_cluster.start_soon_when_requeued(int(job.job_id), 120, time_limit_min=10)
    _check_resumed(job, ckpt, 4, "time_limit", slurm_cluster.kill_wait)
    info = commands.show_job(job.job_id, env=slurm_cluster.env)
    assert info is not None and info["Restarts"] == "1"


def _submit_requeue_template(
    slurm_cluster, tmp_path: Path, export: str = "", sbatch_args: Sequence[str] = ()
) -> tuple[str, Path, Path]:
    """train_requeue.sbatch on 2 nodes of 2 ranks each, training with ``train_until_warned``
    (checkpoints in ``tmp_path/ckpt``, events in ``tmp_path/logs``), ``export`` added to
    its environment, ``sbatch_args`` to sbatch's: the job id, its output file and the
    checkpoint folder."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[2])!r}]\n"
        "from test_preemption import train_until_warned\n"
        f"print(train_until_warned({str(ckpt)!r}, 5))\n"
    )
    srun = Path(__file__).resolve().parents[2] / "bin" / "nvrx-srun"
    env = f"ALL,NVRX_LOG_DIR={tmp_path / 'logs'},NVRX_NPROC_PER_NODE=2,NVRX_SRUN={srun}{export}"
    done = slurm_cluster.run(
        ["sbatch", "--parsable", "-N2", "--time=5", f"--export={env}", "-o", str(tmp_path / "out-%j.txt"),
         *sbatch_args, str(TEMPLATES / "train_requeue.sbatch"), sys.executable, str(script)],
        cwd=tmp_path,
    )  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]
    return job_id, tmp_path / f"out-{job_id}.txt", ckpt


def _warned_requeued_and_resumed(
    slurm_cluster, tmp_path: Path, warning: str, export: str = "", sbatch_args: tuple[str, ...] = ()
) -> list[dict]:
    """train_requeue.sbatch, submitted with ``export`` and ``sbatch_args``, gets ``warning``
    in its batch shell once every rank trains: the job is requeued once by node 0 and its
    second run resumes every rank from its checkpoint and completes. Its events."""
    job_id, out, ckpt = _submit_requeue_template(slurm_cluster, tmp_path, export, sbatch_args)
    wait_until(
        "every rank to train",
        lambda: len(list(ckpt.glob("started-run0-*"))) == 4,
        90,
        state=lambda: out.read_text()[-3000:] if out.exists() else "no output yet",
    )
    slurm_cluster.run(["scancel", f"--signal={warning}", "--batch", job_id])
    slurm_cluster.start_soon_when_requeued(int(job_id), 60)
    assert slurm_cluster.wait_job(int(job_id), timeout=90) == "COMPLETED", out.read_text()
    assert slurm_cluster.job_info(int(job_id))["Restarts"] == "1"
    assert all(json.loads((ckpt / f"rank{r}.json").read_text())["step"] > 0 for r in range(4))
    assert len(list(ckpt.glob("started-run1-*"))) == 4
    events, _ = read_dir(tmp_path / "logs" / job_id)
    requeues = [e for e in events if e["kind"] == "requeue"]
    assert [(e["node"], e["count"]) for e in requeues] == [(0, 1)]
    return events


@pytest.mark.timeout(180)
def test_requeue_template_forwards_the_warning(slurm_cluster, tmp_path: Path) -> None:
    """train_requeue.sbatch: USR2 to the batch shell reaches the supervisors, node 0 requeues."""
    events = _warned_requeued_and_resumed(slurm_cluster, tmp_path, "USR2")
    assert len([e for e in events if e["kind"] == "preempt_signal"]) == 2


#: The warning as USR1, not the templates' USR2 (sbatch's --signal names it too: sbatch expands
#: no variable in #SBATCH lines), and an srun --export that passes PYTHONPATH alone (this
#: checkout's nvrx for the supervisors): nvrx's variables reach them only as nvrx-srun adds them.
USR1_THROUGH_EXPORT = (",NVRX_PREEMPT_SIGNAL=USR1,NVRX_SRUN_ARGS=--export=PYTHONPATH", ("--signal=B:USR1@90",))


@pytest.mark.timeout(180)
def test_another_warning_signal_through_a_restrictive_export_reaches_the_supervisors(
    slurm_cluster, tmp_path: Path
) -> None:
    """train_requeue.sbatch with NVRX_PREEMPT_SIGNAL=USR1 and srun --export=PYTHONPATH: USR1 to
    the batch shell reaches the supervisors, which take it for the warning and write their
    events to NVRX_LOG_DIR; node 0 requeues. Before: the template trapped USR2 alone (USR1
    ended the batch shell), and the --export kept NVRX_PREEMPT_SIGNAL and NVRX_LOG_DIR from the
    supervisors (USR1 ended them)."""
    events = _warned_requeued_and_resumed(slurm_cluster, tmp_path, "USR1", *USR1_THROUGH_EXPORT)
    warned = [e for e in events if e["kind"] == "preempt_signal"]
    assert sorted(e["node"] for e in warned) == [0, 1]


def _srun_dumping_env(tmp_path: Path) -> str:
    """Python code that runs the srun command nvrx-srun builds from its environment, with a
    script in place of the Python that runs the supervisor: each task writes its environment
    to ``tmp_path/env.<SLURM_PROCID>``."""
    dump = tmp_path / "dump"
    dump.write_text(f'#!/bin/sh\n/usr/bin/env > "{tmp_path}/env.$SLURM_PROCID"\n')
    dump.chmod(0o755)
    return (
        "import os; from nvrx.slurm.srun_cli import srun_command; "
        f"c = srun_command(['--', 'true'], os.environ, python={str(dump)!r}); os.execv(c[0], c)"
    )


@pytest.mark.timeout(120)
def test_srun_under_sbatch_export_none_passes_the_variables_nvrx_srun_names(
    slurm_cluster, tmp_path: Path
) -> None:
    """What nvrx-srun relies on (``nvrx.slurm.srun_export``): ``sbatch --export=NONE`` leaves
    SLURM_EXPORT_ENV=NONE to the batch script, and srun follows it; the srun command nvrx-srun
    builds there passes every task the NVRX_* variables, with their values, and none other of
    the user's. Before: the tasks got SLURM's variables alone."""
    build = _srun_dumping_env(tmp_path)
    script = (
        f"export PYTHONPATH={shlex.quote(str(Path(__file__).parents[2]))} NVRX_LOG_DIR=/logs "
        "NVRX_WARNED_AT=1700000000.5 NVRX_JOB_SECRET=ab12 USER_SETTING=1\n"
        'echo "SLURM_EXPORT_ENV=$SLURM_EXPORT_ENV"\n'
        f"exec {shlex.quote(sys.executable)} -c {shlex.quote(build)}\n"
    )
    out = tmp_path / "out.txt"
    job = slurm_cluster.sbatch(script, "-N2", "--export=NONE", "-o", str(out))
    assert slurm_cluster.wait_job(job, timeout=90) == "COMPLETED", out.read_text()
    assert out.read_text().startswith("SLURM_EXPORT_ENV=NONE\n"), out.read_text()
    for rank in (0, 1):
        env = dict(line.split("=", 1) for line in (tmp_path / f"env.{rank}").read_text().splitlines())
        mine = {k: v for k, v in env.items() if k.startswith("NVRX_")}
        assert mine == {"NVRX_LOG_DIR": "/logs", "NVRX_WARNED_AT": "1700000000.5", "NVRX_JOB_SECRET": "ab12"}
        assert "USER_SETTING" not in env and "PYTHONPATH" not in env  # NONE, but for nvrx's


@pytest.mark.timeout(120)
@pytest.mark.parametrize("given", ["PATH,NONE,USER_SETTING", "NONE,ALL"])
def test_srun_reads_no_export_item_past_none_and_nvrx_srun_names_its_variables_before_it(
    slurm_cluster, tmp_path: Path, given: str
) -> None:
    """``NVRX_SRUN_ARGS=--export=<given>``: srun reads the items before a ``NONE`` alone, so
    the names nvrx-srun adds go before it; every task gets the NVRX_* variables, and ``USER_SETTING``
    (past ``NONE``) none. Before: the names went after ``NONE`` (``PATH,NONE,USER_SETTING,NVRX_...``),
    or ``NONE,ALL`` was taken for ``ALL`` and left as it was, and the tasks had none of them."""
    build = _srun_dumping_env(tmp_path)
    script = (
        f"export NVRX_LOG_DIR=/logs NVRX_SRUN_ARGS=--export={given} USER_SETTING=1\n"
        f"exec {shlex.quote(sys.executable)} -c {shlex.quote(build)}\n"
    )
    out = tmp_path / "out.txt"
    env = f"ALL,PYTHONPATH={Path(__file__).parents[2]}"
    job = slurm_cluster.sbatch(script, "-N2", f"--export={env}", "-o", str(out))
    assert slurm_cluster.wait_job(job, timeout=90) == "COMPLETED", out.read_text()
    for rank in (0, 1):
        env_of = dict(line.split("=", 1) for line in (tmp_path / f"env.{rank}").read_text().splitlines())
        assert env_of.get("NVRX_LOG_DIR") == "/logs", sorted(env_of)
        assert "USER_SETTING" not in env_of and "PYTHONPATH" not in env_of  # past NONE, or not named


def _nvrx_srun_checking(patterns: Path) -> int:
    """The pid of the nvrx-srun whose check of the options reads ``patterns``."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "nvrx.supervisor.check_args" in cmdline and any(str(patterns) in a for a in cmdline):
            return proc.ppid()
    raise AssertionError(f"no check of nvrx-srun reads {patterns}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("given", "signum"),
    [(("", ()), signal.SIGUSR2), (USR1_THROUGH_EXPORT, signal.SIGUSR1)],
    ids=["usr2", "usr1-through-export"],
)
def test_a_warning_before_srun_ran_is_kept_and_the_job_requeued(
    slurm_cluster, tmp_path: Path, given: tuple[str, tuple[str, ...]], signum: int
) -> None:
    """train_requeue.sbatch: SLURM's warning reaches nvrx-srun, as the batch shell forwards it,
    while nvrx-srun checks the supervisor's options (held on a FIFO it reads): it keeps the
    warning, the supervisors act on it, node 0 requeues, and the next run, warned of nothing,
    trains to its end (before: nvrx-srun ended with the signal, exit 140, and the job failed).
    Also with USR1 and an srun --export that passes PYTHONPATH alone (before: the --export
    dropped NVRX_WARNED_AT, and the supervisors trained on, unwarned)."""
    patterns = tmp_path / "patterns"
    os.mkfifo(patterns)
    export = f",NVRX_SUPERVISE_ARGS=--ft-non-retryable-exception-file={patterns}{given[0]}"
    job_id, out, ckpt = _submit_requeue_template(slurm_cluster, tmp_path, export, given[1])
    opened: list[int] = []
    try:
        wait_until("nvrx-srun's check to open its pattern file",
                   lambda: open_for_writing(patterns, opened), 90,
                   state=lambda: out.read_text()[-3000:] if out.exists() else "no output yet")  # fmt: skip
        os.kill(_nvrx_srun_checking(patterns), signum)  # what the template's trap does
        given = tmp_path / "patterns.txt"  # what the supervisors, and the next run, read
        given.write_text("NotRetryable\n")
        os.replace(given, patterns)
        os.write(opened[0], b"NotRetryable\n")
    finally:
        for fd in opened:
            os.close(fd)
    slurm_cluster.start_soon_when_requeued(int(job_id), 90)
    assert slurm_cluster.wait_job(int(job_id), timeout=90) == "COMPLETED", out.read_text()
    assert slurm_cluster.job_info(int(job_id))["Restarts"] == "1"
    assert len(list(ckpt.glob("started-run1-*"))) == 4
    events, _ = read_dir(tmp_path / "logs" / job_id)
    kept = [e["node"] for e in events if e["kind"] == "signal_received" and "nvrx-srun" in e["action"]]
    assert sorted(kept) == [0, 1]
    assert len([e for e in events if e["kind"] == "preempt_signal"]) == 2  # the first run's only
    requeues = [e for e in events if e["kind"] == "requeue"]
    assert [(e["node"], e["count"]) for e in requeues] == [(0, 1)]


@pytest.mark.timeout(120)
def test_srun_started_with_the_warning_blocked_and_pending_runs_its_step(
    slurm_cluster, tmp_path: Path
) -> None:
    """What nvrx-srun relies on (``nvrx.slurm.early_warning``): it execs srun with the warning
    signal blocked, and one may be pending then. SLURM's srun blocks it itself and takes it
    with sigwait: it runs its step and exits 0, not 140."""
    become_srun = (
        "import os, signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2}); "
        "os.kill(os.getpid(), signal.SIGUSR2); os.execvp('srun', ['srun', '-N1', '-n1', 'true'])"
    )
    job = slurm_cluster.sbatch(
        f'{shlex.quote(sys.executable)} -c {shlex.quote(become_srun)}\necho "srun exited $?"\n',
        "-N1", "-o", str(tmp_path / "out.txt"),
    )  # fmt: skip
    assert slurm_cluster.wait_job(job, timeout=90) == "COMPLETED"
    assert (tmp_path / "out.txt").read_text() == "srun exited 0\n"
