"""A new user's mistakes at the command lines, each answered with one line and the right exit code.

The convention for every nvrx program: bad input or a failed run ends with one line on
stderr, ``<program>: ...`` (``<program>: error: ...`` but for nvrx-report's own errors),
naming what to fix; before it at most one ``usage:`` line, for a usage error that argparse
(or nvrx-srun, in argparse's manner) answers. Exit 2 for a usage error (a bad option or
value, or a name that matches nothing), 1 for a failure of the run (a directory that cannot
be read, a file that cannot be written). A warning is one line, ``<program>: warning: ...``,
and leaves the exit code alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from test_report_fixtures import JOB, write_standard_job

from nvrx.report import cli as report_cli
from nvrx.slurm import srun_cli, template_cli
from nvrx.supervisor import cli as supervise_cli
from nvrx.supervisor.cli import config_from_args
from nvrx.supervisor.config import ConfigError
from tests.support.as_user import run_as, unprivileged_ids

#: The module whose ``main`` is nvrx-report.
REPORT = ["nvrx.report.cli"]

PROGRAMS: dict[str, Callable[[Sequence[str]], int]] = {
    "nvrx-supervise": supervise_cli.main,
    "nvrx-report": report_cli.main,
    "nvrx-srun": srun_cli.main,
    "nvrx-template": template_cli.main,
}
_STORE = (
    "is not needed: node 0's supervisor hosts the job's store (give --master-addr/--master-port"
)

#: (program, argv, exit code, a piece of the last line); ``{job}`` is a job's log directory,
#: ``{tmp}`` a scratch folder.
BAD_INPUT = [
    ("nvrx-supervise", ["--standalone", "--", "python", "x.py"], 2,
     "error: --standalone is not needed: a single node is the default (drop it)"),
    ("nvrx-supervise", ["--rdzv-backend", "c10d", "--", "python"], 2, f"error: --rdzv-backend {_STORE}"),
    ("nvrx-supervise", ["--rdzv_backend=c10d", "--", "python"], 2, f"error: --rdzv_backend {_STORE}"),
    ("nvrx-supervise", ["--rdzv-endpoint=h:29400", "--", "python"], 2, f"--rdzv-endpoint {_STORE}"),
    ("nvrx-supervise", ["--rdzv_id", "7", "--", "python"], 2, f"--rdzv_id {_STORE}"),
    ("nvrx-supervise", ["--rdzv-conf", "timeout=9", "--", "python"], 2, f"--rdzv-conf {_STORE}"),
    ("nvrx-supervise", ["--nnodes", "1:4", "--", "python"], 2,
     "torchrun's MIN:MAX node range is --nnodes N --spare-nodes K here"),
    ("nvrx-supervise", ["-m", "pkg.train"], 2, "-m is not needed: the command after '--' runs as "
     "given: write 'python -m MODULE' after '--'"),
    ("nvrx-supervise", ["--module", "pkg.train"], 2, "--module is not needed"),
    ("nvrx-supervise", ["--no-python", "--", "./train.sh"], 2,
     "--no-python is not needed: the command after '--' runs as given"),
    ("nvrx-supervise", ["--run-path", "train.py"], 2, "--run-path is not needed"),
    ("nvrx-supervise", ["--start-method", "spawn", "--", "python"], 2, "--start-method is not needed"),
    ("nvrx-supervise", ["--role", "trainer", "--", "python"], 2, "--role is not needed"),
    ("nvrx-supervise", ["--term-timeout", "5", "--", "python"], 2, "--term-timeout is --grace-period here"),
    ("nvrx-supervise", ["--bogus", "--", "python"], 2, "error: unrecognized arguments: --bogus"),
    ("nvrx-report", ["{job}", "--rank", "99", "--no-sacct"], 2, "no rank 99 in '{job}': ranks 0-3"),
    ("nvrx-report", ["{job}", "--node", "9", "--no-sacct"], 2, "no node 9 in '{job}': nodes 0-1"),
    ("nvrx-report", ["{job}", "--job", "nope", "--no-sacct"], 2, f"no job 'nope' in '{{job}}': jobs {JOB}"),
    ("nvrx-report", ["{tmp}/missing"], 2, "log directory '{tmp}/missing' does not exist"),
    ("nvrx-report", ["--rank", "x"], 2, "error: argument --rank: invalid int value: 'x'"),
    ("nvrx-report", ["{job}", "--workers", "0"], 2,
     "error: argument --workers: --workers must be a number of processes, at least 1, got '0'"),
    ("nvrx-report", ["{job}", "--workers", "-3"], 2, "--workers must be a number of processes, at least 1, got '-3'"),
    ("nvrx-srun", [], 2, "error: no training command: put it after '--'"),
    ("nvrx-template", ["train", "--srun", "/nonexistent/nvrx-srun"], 0,
     "warning: --srun /nonexistent/nvrx-srun is not an executable file on this machine"),
    ("nvrx-template", ["train", "-o", "{tmp}/no/such/x.sbatch"], 1,
     "error: cannot write {tmp}/no/such/x.sbatch: folder {tmp}/no/such does not exist"),
    ("nvrx-template", ["--bogus"], 2, "error: unrecognized arguments: --bogus"),
    ("nvrx-template", ["train", "--srun", ""], 2,
     "error: --srun '' names no nvrx-srun: give its path, or leave --srun out"),
]  # fmt: skip


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("logs") / JOB
    write_standard_job(path)
    return path


def _run(program: str, argv: Sequence[str]) -> int:
    """The program's exit code, run in this process (argparse's exit included)."""
    try:
        return PROGRAMS[program](list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def check_one_line(program: str, stderr: str, code: int) -> str:
    """The line that answers: the only non-empty line of ``stderr``, or the one after a usage
    line of a usage error."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if code == 2 and len(lines) == 2:
        assert lines[0].startswith(f"usage: {program} "), stderr
        lines = lines[1:]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{program}: "), stderr
    return lines[0]


@pytest.mark.parametrize(("program", "argv", "code", "fragment"), BAD_INPUT)
def test_bad_input_gets_one_line_and_its_exit_code(
    program: str, argv: list[str], code: int, fragment: str, job_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)  # a template written by mistake lands here
    values = {"job": str(job_dir), "tmp": str(tmp_path)}
    argv = [a.format(**values) for a in argv]
    assert _run(program, argv) == code
    line = check_one_line(program, capsys.readouterr().err, code)
    assert fragment.format(**values) in line


def test_torchrun_options_after_the_command_are_the_commands() -> None:
    command = ["python", "x.py", "--standalone", "--rdzv-backend", "c10d", "-m", "--nnodes", "1:2"]
    cfg, _ = config_from_args(
        ["--master-port", "30030", "--", *command], {"PATH": os.environ["PATH"]}
    )
    assert cfg.command == command


def test_the_template_with_a_foreign_srun_is_still_written(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    assert template_cli.main(["train", "--srun", "/cluster/bin/nvrx-srun", "-o", str(out)]) == 0
    assert '[ -n "${NVRX_SRUN:-}" ] || NVRX_SRUN=/cluster/bin/nvrx-srun  # written' in out.read_text()


@pytest.fixture
def unsearchable_job() -> Iterator[Path]:
    """A job's log directory whose names can be listed but whose files cannot be opened
    (mode 0o444), in a folder any user may enter."""
    folder = Path(tempfile.mkdtemp(prefix="nvrx-unsearchable-"))
    folder.chmod(0o755)
    job = folder / JOB
    write_standard_job(job)
    job.chmod(0o444)
    try:
        yield job
    finally:
        job.chmod(0o755)
        shutil.rmtree(folder)


def _unprivileged_ids() -> tuple[int, int]:
    return unprivileged_ids("root reads any directory")


def test_an_unsearchable_log_directory_is_one_line_and_exit_1(unsearchable_job: Path) -> None:
    uid, gid = _unprivileged_ids()
    done = run_as(REPORT, (uid, gid), [str(unsearchable_job), "--no-sacct"], timeout=60)
    assert done.returncode == 1, done.stderr
    line = check_one_line("nvrx-report", done.stderr, 1)
    assert f"cannot read log directory {str(unsearchable_job)!r}" in line
    assert "chmod u+rx" in line


def test_a_job_under_a_base_that_may_be_entered_but_not_listed_is_read(tmp_path: Path) -> None:
    """Shared scratch often has mode 0o711: ``--job`` names the job, the base is never listed."""
    folder = Path(tempfile.mkdtemp(prefix="nvrx-enter-only-"))
    try:
        write_standard_job(folder / JOB)
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        folder.chmod(0o711)
        uid, gid = _unprivileged_ids()
        done = run_as(REPORT, (uid, gid), [str(folder), "--job", JOB, "--no-sacct"], timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"job {JOB}" in done.stdout, done.stdout
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A base log folder any user may enter and list, as a team's shared scratch is; each
    test writes job folders into it. Every mode is opened again before it is removed."""
    folder = Path(tempfile.mkdtemp(prefix="nvrx-shared-base-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o755)
        shutil.rmtree(folder)


def _job(base: Path, name: str, mtime: float) -> Path:
    """A job's folder under ``base``, open to every user, its files and itself changed at ``mtime``."""
    write_standard_job(base / name)
    for path in [*(base / name).rglob("*"), base / name]:
        path.chmod(0o755 if path.is_dir() else 0o644)
        os.utime(path, (mtime, mtime))
    return base / name


def _report_as_another_user(*argv: str) -> subprocess.CompletedProcess[str]:
    """nvrx-report run as a user other than the owner of the files (``nobody`` when root)."""
    uid, gid = _unprivileged_ids()
    return run_as(REPORT, (uid, gid), [*argv, "--no-sacct"], timeout=60)


#: The mode that keeps another user out of a job folder (the supervisor makes them 0700,
#: the owner's only; 0 keeps out its owner too, where the test does not run as root).
CLOSED = 0o000


def test_a_newer_job_folder_that_cannot_be_read_is_named_not_passed_over(shared_base: Path) -> None:
    """Before: the older job was reported, exit 0, with no word of the newer one."""
    _job(shared_base, "100", 1_700_000_000)
    newer = _job(shared_base, "200", 1_700_000_500)
    newer.chmod(CLOSED)
    done = _report_as_another_user(str(shared_base))
    assert done.returncode == 1, done.stdout + done.stderr
    line = check_one_line("nvrx-report", done.stderr, 1)
    assert f"cannot read job folder {str(newer)!r}" in line and "--job 100" in line, line
    assert done.stdout == ""


def test_an_older_job_folder_that_cannot_be_read_is_a_note_of_the_report(shared_base: Path) -> None:
    older = _job(shared_base, "100", 1_700_000_000)
    _job(shared_base, "200", 1_700_000_500)
    older.chmod(CLOSED)
    done = _report_as_another_user(str(shared_base), "--width", "0")
    assert done.returncode == 0, done.stderr
    assert "may not read were skipped: 100 (none changed after 200's" in done.stdout


def test_a_base_whose_only_job_folder_cannot_be_read_exits_1_naming_it(shared_base: Path) -> None:
    """Before: 'no event files in BASE: the directory is empty', exit 2."""
    only = _job(shared_base, "300", 1_700_000_000)
    only.chmod(CLOSED)
    done = _report_as_another_user(str(shared_base))
    assert done.returncode == 1, done.stderr
    line = check_one_line("nvrx-report", done.stderr, 1)
    assert f"that this user may read: cannot read {str(only)!r}" in line, line
    assert "empty" not in line


def test_a_file_systems_lost_and_found_is_no_job_folder(shared_base: Path) -> None:
    """A log folder at a mount's root holds ``lost+found`` (root's, 0700): not a job, so
    neither the newest job nor a folder this user was kept out of."""
    _job(shared_base, "100", 1_700_000_000)
    found = shared_base / "lost+found"
    found.mkdir()
    found.chmod(CLOSED)
    done = _report_as_another_user(str(shared_base), "--width", "0")
    assert done.returncode == 0, done.stderr
    assert f"job {JOB}" in done.stdout and "lost+found" not in done.stdout + done.stderr


@pytest.mark.parametrize("closed", ["supervisor", "folder"])
def test_a_job_with_an_event_file_or_folder_that_cannot_be_read_exits_1(
    shared_base: Path, closed: str
) -> None:
    """Before: the unreadable supervisor file was skipped, its end event with it, and the
    report said "NOT FINISHED: unknown (still running...)", exit 0."""
    job = _job(shared_base, JOB, 1_700_000_000)
    if closed == "supervisor":
        target = sorted(job.glob("supervisor-*.jsonl"))[0]
        expected = f"cannot read event file {str(target)!r} (and 1 more)"
        for path in job.glob("supervisor-*.jsonl"):
            path.chmod(CLOSED)
    else:
        target = job / "more"
        target.mkdir()
        (target / "rank9.jsonl").write_text("")
        target.chmod(CLOSED)
        expected = f"cannot list folder {str(target)!r} of log directory {str(job)!r}"
    done = _report_as_another_user(str(job))
    assert done.returncode == 1, done.stdout + done.stderr
    assert expected in check_one_line("nvrx-report", done.stderr, 1)


def test_every_torchrun_option_is_taken_or_answered() -> None:
    """An option torchrun gains shows here: nvrx-supervise takes it or answers it in one line."""
    import torch.distributed.run as torchrun

    from nvrx.supervisor.cli import build_parser

    theirs = {s for a in torchrun.get_args_parser()._actions for s in a.option_strings}
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    assert sorted(s for s in theirs if s not in ours and s.replace("_", "-") not in ours) == []


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("bogus", "NVRX_PREEMPT_SIGNAL='bogus' is not a signal name"),
        ("TERM", "NVRX_PREEMPT_SIGNAL='TERM': the warning signal must be USR1 or USR2"),
        ("ALRM", "NVRX_PREEMPT_SIGNAL='ALRM': the warning signal must be USR1 or USR2"),
    ],
)
def test_a_bad_warning_signal_is_one_line_and_exit_2(
    value: str, fragment: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a traceback and exit 1 for a name that is no signal; TERM was taken, and every
    process nvrx started ignored scancel's SIGTERM; ALRM ended the supervisor."""
    monkeypatch.setenv("NVRX_PREEMPT_SIGNAL", value)
    assert supervise_cli.main(["--nproc-per-node", "1", "--", "python", "x.py"]) == 2
    assert fragment in check_one_line("nvrx-supervise", capsys.readouterr().err, 2)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("NVRX_SIGNAL_DELAY_S", "90s"), ("NVRX_MAX_TIME_LIMIT_REQUEUES", "many"),
     ("NVRX_PREEMPT_WINDOW_S", "-5")],  # fmt: skip
)
def test_a_bad_warning_setting_is_a_usage_error(variable: str, value: str) -> None:
    """Before: taken at parse time, then read as the supervisor started: a traceback, exit 1."""
    with pytest.raises(ConfigError, match=f"{variable}='{value}'"):
        config_from_args(["--nproc-per-node", "1", "--", "python", "x.py"], env={variable: value})


def test_a_report_warning_is_one_line_in_the_warning_form(job_dir: Path) -> None:
    """An output file that cannot be read (``/proc/self/mem``: opened, its read fails) is a
    warning and a note of the report, which is printed all the same (exit 0)."""
    argv = [sys.executable, "-m", "nvrx.report", str(job_dir), "--no-sacct",
            "--slurm-output", "/proc/self/mem"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = check_one_line("nvrx-report", done.stderr, 0)
    assert line.startswith("nvrx-report: warning: cannot read /proc/"), line
    assert "cannot read output file" in done.stdout
