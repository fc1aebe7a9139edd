"""Input to nvrx-supervise that used to end in a traceback, a misleading line or a silent
default: each now gets one line naming what to fix, with its exit code (2: usage)."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvrx.supervisor.cli import NOT_EMPTY, config_from_args
from nvrx.supervisor.config import MAX_SECONDS, ConfigError, SupervisorConfig, local_job
from nvrx.supervisor.local_ranks import why_not_started
from tests.support.as_user import run_as, unprivileged_ids

PROG = "nvrx-supervise"

def _supervise(*argv: str, user: tuple[int, int] = (-1, -1)) -> subprocess.CompletedProcess[str]:
    """nvrx-supervise run in a child process (as ``user``'s (uid, gid) where not -1)."""
    return run_as(["nvrx.supervisor.cli", "nvrx.supervisor.supervisor"], user, list(argv))


def _one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line of stderr, an error of nvrx-supervise, after exit ``code``."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{PROG}: error: "), result.stderr
    return lines[0]


@pytest.fixture
def read_only_base() -> Iterator[tuple[Path, tuple[int, int]]]:
    """A folder no one but root may write in (mode 0o555), and who to run as so that the
    mode stops them: ``nobody`` where this test runs as root, else the user it runs as."""
    user = unprivileged_ids("root writes anywhere")
    folder = Path(tempfile.mkdtemp(prefix="nvrx-read-only-"))
    folder.chmod(0o555)
    try:
        yield folder, user
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_a_read_only_log_dir_is_one_line_and_exit_2(
    read_only_base: tuple[Path, tuple[int, int]],
) -> None:
    """Before: PermissionError's traceback from the job folder's mkdir, exit 1."""
    base, user = read_only_base
    argv = ["--master-port", "29800", "--job-id", "j", "--log-dir", str(base), "--", "true"]
    line = _one_error_line(_supervise(*argv, user=user), 2)
    assert line == (
        f"{PROG}: error: cannot create the job folder {base}/j: Permission denied; "
        "choose another --log-dir"
    )


@pytest.mark.parametrize(
    ("log_dir", "reason"),
    [
        ("{tmp}/afile", "Not a directory"),  # a regular file
        ("{tmp}/afile/logs", "Not a directory"),  # a regular file on the way
        ("/proc/nvrx-no-such", "No such file or directory"),  # a place where none can be made
    ],
)
def test_a_log_dir_that_cannot_hold_the_job_folder_is_one_line_and_exit_2(
    log_dir: str, reason: str, tmp_path: Path
) -> None:
    """Before: NotADirectoryError's or FileNotFoundError's traceback, exit 1; the event
    writer's warnings came first."""
    (tmp_path / "afile").write_text("")
    log_dir = log_dir.format(tmp=tmp_path)
    argv = ["--master-port", "29800", "--job-id", "j", "--log-dir", log_dir, "--", "true"]
    line = _one_error_line(_supervise(*argv), 2)
    assert line == (
        f"{PROG}: error: cannot create the job folder {log_dir}/j: {reason}; choose another --log-dir"
    )


def _config(*options: str, env: dict[str, str] | None = None) -> SupervisorConfig:
    """The configuration of ``options`` for a job of 3 local nodes (no free ports looked for)."""
    topology = ["--nnodes", "3", "--node-rank", "0", "--master-port", "30100"]
    argv = [*topology, *options, "--", "python", "t.py"]
    return config_from_args(argv, {"PATH": os.environ["PATH"], **(env or {})})[0]


#: Every option that sets a float of the configuration, by the field it sets.
FLOAT_OPTIONS = {
    "grace_period": "--grace-period",
    "store_timeout": "--store-timeout",
    "finish_timeout": "--finish-timeout",
    "node_heartbeat": "--node-heartbeat",
    "node_timeout": "--node-timeout",
    "standby_wait": "--standby-wait",
    "straggler_threshold": "--straggler-threshold",
}
DURATIONS = [option for field, option in FLOAT_OPTIONS.items() if field != "straggler_threshold"]


def test_the_float_options_below_are_every_float_of_the_configuration() -> None:
    floats = {f.name for f in dataclasses.fields(SupervisorConfig) if f.type == "float"}
    assert floats == set(FLOAT_OPTIONS)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e300", "86400.5"])
@pytest.mark.parametrize("option", DURATIONS)
def test_a_duration_that_is_not_finite_or_too_long_names_the_option(option: str, value: str) -> None:
    """Before: inf and 1e300 were taken (--store-timeout: an OverflowError's traceback at
    the start; --grace-period, --finish-timeout, --node-timeout: waits without end)."""
    shown = f"{float(value):g}"
    with pytest.raises(ConfigError, match=rf"^{option} must be .*at most|^{option} must be in") as exc:
        _config(f"{option}={value}")  # (=: argparse would take -inf for an option)
    assert str(exc.value).endswith(f"{MAX_SECONDS:g} seconds, got {shown}"), exc.value


@pytest.mark.parametrize("value", ["inf", "nan", "1e300"])
def test_a_straggler_threshold_that_is_not_finite_names_the_option(value: str) -> None:
    shown = f"{float(value):g}"
    with pytest.raises(ConfigError, match=re.escape(f"--straggler-threshold must be in (0, 1), got {shown}")):
        _config("--straggler-threshold", value)


@pytest.mark.parametrize("option", DURATIONS)
def test_a_duration_of_a_day_is_taken(option: str) -> None:
    extra = ["--node-timeout", "86400"] if option == "--node-heartbeat" else []
    day = "43200" if option == "--node-heartbeat" else "86400"  # the timeout: twice as long
    cfg = _config(*extra, option, day)
    field = next(f for f, o in FLOAT_OPTIONS.items() if o == option)
    assert getattr(cfg, field) == float(day)


def test_a_node_timeout_from_the_templates_variable_is_bounded_too() -> None:
    """Named as the variable it came from: the user gave no ``--node-timeout``."""
    with pytest.raises(ConfigError, match="^NVRX_NODE_TIMEOUT_S='inf' must be at most 86400 seconds$"):
        _config(env={"NVRX_NODE_TIMEOUT_S": "inf"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--ft-rank-heartbeat-timeout", "86401"], "rank_heartbeat_timeout must be at most 86400 seconds, got 86401"),
        (["--ft-initial-rank-heartbeat-timeout", "1e300"], "initial_rank_heartbeat_timeout must be at most 86400 seconds, got 1e+300"),
        (["--ft-rank-out-of-section-timeout", "1e7"], "rank_out_of_section_timeout must be at most 86400 seconds, got 1e+07"),
        (["--ft-rank-section-timeouts", "step:60,save:1e300"], "rank_section_timeouts['save'] must be at most 86400 seconds, got 1e+300"),
        (["--ft-rank-heartbeat-timeout", "inf"], "rank_heartbeat_timeout must be a finite number of seconds, got 'inf'"),
    ],
)  # fmt: skip
def test_a_fault_tolerance_timeout_longer_than_a_day_names_the_setting(
    options: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"fault tolerance: {message}")):
        _config(*options)
    _config(options[0], "step:86400" if options[0].endswith("section-timeouts") else "86400")


@pytest.mark.parametrize("job_id", [".", "..", ".hidden", "a/b", "/", "a\0b"])
def test_a_job_id_that_is_no_folder_of_its_own_names_the_rule(job_id: str) -> None:
    """Before: '.' and '..' were taken, and the job's files (secret, events) went to the
    log folder itself or the one around it, which was made owner-only."""
    rule = (
        "--job-id must name a folder of its own in --log-dir: not empty, not starting with '.' "
        f"(as '.' and '..' do), without '/' or NUL; got {job_id!r}"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(rule)}$"):
        SupervisorConfig(command=["train"], job=local_job(job_id=job_id))
    if "\0" not in job_id:  # (no command line holds a NUL)
        with pytest.raises(ConfigError, match=re.escape(rule)):
            _config("--job-id", job_id)
        with pytest.raises(ConfigError, match=re.escape(rule)):
            _config(env={"NVRX_JOB_ID": job_id})


@pytest.mark.parametrize("job_id", ["7", "a.b", "job-1_x.."])
def test_a_job_id_with_dots_inside_is_taken(job_id: str) -> None:
    assert _config("--job-id", job_id).job_id == job_id


def test_a_job_id_of_dot_dot_leaves_the_folder_around_alone(tmp_path: Path) -> None:
    """The audit's case: ``cd /tmp/x && nvrx-supervise --job-id .. -- true`` wrote the secret
    and the events to /tmp and made it owner-only."""
    around = tmp_path / "around"
    (around / "x").mkdir(parents=True)
    around.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "nvrx.supervisor.cli", "--master-port", "29800", "--job-id", "..",
         "--log-dir", ".", "--", "true"],
        capture_output=True, text=True, timeout=120, cwd=around / "x",
    )  # fmt: skip
    assert "--job-id must name a folder of its own" in _one_error_line(result, 2)
    assert sorted(p.name for p in around.iterdir()) == ["x"] and list((around / "x").iterdir()) == []
    assert around.stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("dest", NOT_EMPTY)
def test_an_option_given_empty_is_an_error_naming_it(dest: str) -> None:
    """Before: ``--job-id ''``, ``--master-addr ''``, ``--log-dir ''`` (and the others) stood
    for their defaults, silently."""
    option = "--" + dest.replace("_", "-")
    message = f"^{option} must not be empty: give a value or leave the option out$"
    with pytest.raises(ConfigError, match=message):
        _config(option, "")
    with pytest.raises(ConfigError, match=message):
        _config(f"{option}=")


@pytest.mark.parametrize("option", ["--job-id", "--log-dir"])
def test_an_empty_option_is_an_error_under_slurm_too(option: str) -> None:
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "77", "SLURM_PROCID": "0",
           "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1"}  # fmt: skip
    config_from_args(["--", "python"], env)  # a topology SLURM gives
    with pytest.raises(ConfigError, match=f"^{option} must not be empty"):
        config_from_args([option, "", "--", "python"], env)


def test_an_empty_pet_master_addr_is_an_error_naming_the_variable() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("$PET_MASTER_ADDR (for --master-addr) is empty: set a value or unset it")
    ):
        config_from_args(["--", "python"], {"PATH": os.environ["PATH"], "PET_MASTER_ADDR": ""})


def test_a_script_whose_interpreter_is_missing_is_named_in_one_line_and_exit_7(
    tmp_path: Path,
) -> None:
    """Before: "cannot start './badshebang.sh': No such file or directory", of a file that
    is there: the kernel's ENOENT was for the interpreter of its #! line."""
    script = tmp_path / "badshebang.sh"
    script.write_text("#!/nonexistent/interp -e\necho never\n")
    script.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "nvrx.supervisor.cli", "--master-port", "29800",
         "--log-dir", "logs", "--", "./badshebang.sh"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 7, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].endswith(
        "cannot start './badshebang.sh': its interpreter '/nonexistent/interp' (the #! line "
        "of ./badshebang.sh) does not exist"
    ), result.stderr


def test_why_not_started_names_the_interpreter_only_where_it_is_missing(tmp_path: Path) -> None:
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory")
    script = tmp_path / "run.sh"
    script.write_text("#!  /no/such/python3 -u\n")
    assert why_not_started(str(script), missing) == (
        f"its interpreter '/no/such/python3' (the #! line of {script}) does not exist"
    )
    script.write_text(f"#!{sys.executable}\n")  # there: something further down is missing
    assert why_not_started(str(script), missing) == (
        f"No such file or directory (the #! line of {script} names {sys.executable!r}, which "
        "cannot be run)"
    )
    script.write_bytes(b"\x7fELF...")  # a program whose loader is missing
    assert why_not_started(str(script), missing) == (
        "No such file or directory (the file exists: the program loader it needs is missing)"
    )
    assert why_not_started(str(tmp_path / "gone"), missing) == "No such file or directory"
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert why_not_started(str(script), denied) == "Permission denied"
