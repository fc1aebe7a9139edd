"""nvrx's sbatch templates, ``nvrx-template`` that writes them, and ``nvrx-srun`` that they run.

The templates are shell scripts: they are run here with bash, SLURM's variables
set and a stand-in nvrx-srun that records what it was given (what runs under
SLURM itself is in ``tests/slurm/test_templates_slurm.py``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx import processes
from nvrx.report.slurm_context import find_output_files
from nvrx.slurm import srun_cli, template_cli
from nvrx.store.seal import MIN_SECRET_BYTES, parse_secret
from tests.support.waiting import wait_until

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SRUN = "/opt/nvrx env/bin/nvrx-srun"  # a space: the path must be quoted where it is used
NAMES = ["train", "train_requeue", "train_spares"]
#: Set to 1 to rewrite the golden files after a deliberate change of a template.
UPDATE = os.environ.get("NVRX_UPDATE_GOLDEN") == "1"


def test_the_three_templates_ship_in_the_package() -> None:
    assert template_cli.names() == NAMES
    checkout = Path(__file__).resolve().parents[2] / "sbatch_templates"
    assert sorted(p.stem for p in checkout.glob("*.sbatch")) == NAMES  # the same folder


@pytest.mark.parametrize("name", NAMES)
def test_rendered_template_matches_its_golden_file(name: str) -> None:
    rendered = template_cli.render(name, SRUN)
    golden = GOLDEN / f"{name}.sbatch"
    if UPDATE:
        golden.write_text(rendered)
    assert rendered == golden.read_text(), f"rerun with NVRX_UPDATE_GOLDEN=1 if {name} changed on purpose"
    assert subprocess.run(["bash", "-n"], input=rendered, text=True).returncode == 0


@pytest.mark.parametrize("name", NAMES)
def test_every_template_speaks_the_same_variables(name: str) -> None:
    text = template_cli.text(name)
    for needed in ("NVRX_NPROC_PER_NODE", "NVRX_LOG_DIR", "NVRX_SUPERVISE_ARGS", "NVRX_SRUN_ARGS",
                   "NVRX_SIGNAL_DELAY_S", "#SBATCH --requeue", "#SBATCH --no-kill",
                   "#SBATCH --output=nvrx-%j.out", '"$NVRX_SRUN" --nproc-per-node'):  # fmt: skip
        assert needed in text, f"{name} lacks {needed}"
    for old in ("NPROC_PER_NODE=", "NVRX_NPROC=", "NVRX_PYTHON", "NVRX_REPO", "nvrx.supervisor.cli"):
        assert old not in text, f"{name} still has {old}"
    delay = re.search(r"#SBATCH --signal=B:USR2@(\d+)", text)
    assert delay and f'NVRX_SIGNAL_DELAY_S:-{delay[1]}}}' in text  # the two agree
    # the warning signal: the one nvrx-srun and the supervisors read, which --signal must name
    assert 'warning="${NVRX_PREEMPT_SIGNAL:-USR2}"' in text
    assert "trap 'forward \"$warning\"' \"$warning\"" in text and "forward USR2" not in text
    header = " ".join(line.lstrip("# ") for line in text.split("\n#SBATCH", 1)[0].splitlines())
    assert "sbatch reads #SBATCH lines as written, with no variable expanded" in header


def _fake_srun(tmp_path: Path, exit_code: int = 0, name: str = "fake srun") -> Path:
    """A stand-in for nvrx-srun that writes its arguments and environment, then exits."""
    fake = tmp_path / name
    fake.write_text(
        "#!/bin/bash\n"
        f'printf "%s\\n" "$@" > "{tmp_path}/args"\n'
        f'env > "{tmp_path}/env"\n'
        f"exit {exit_code}\n"
    )
    fake.chmod(0o755)
    return fake


def _run(tmp_path: Path, name: str, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"{name}.sbatch"
    script.write_text(template_cli.render(name, str(_fake_srun(tmp_path, int(env.pop("EXIT", "0"))))))
    slurm = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
             "SLURM_SUBMIT_DIR": str(tmp_path), "PATH": os.environ["PATH"]}  # fmt: skip
    return subprocess.run(
        ["bash", str(script), *args], env={**slurm, **env}, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize("name", NAMES)
def test_a_template_runs_nvrx_srun_with_the_command_and_settings(tmp_path: Path, name: str) -> None:
    done = _run(tmp_path, name, ["python", "train.py", "--lr", "0.1 0.2"],
                NVRX_NPROC_PER_NODE="4", NVRX_SUPERVISE_ARGS="--max-restarts 3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args == ["--nproc-per-node", "4", "--max-restarts", "3", "--", "python", "train.py",
                    "--lr", "0.1 0.2"]  # fmt: skip
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert env["NVRX_LOG_DIR"] == f"{tmp_path}/nvrx_logs"
    assert env["NVRX_SIGNAL_DELAY_S"] in ("60", "90")
    assert "supervisors ended with exit code 0" in done.stdout


#: nvrx-srun paths that the shell must take as they are: spaces, both quotes, braces (a }
#: ended the old ${NVRX_SRUN:-...}), $ and ` (expansions), backslashes, a newline.
AWKWARD_PATHS = [
    SRUN, "a b'c", "/x/}y", "/x/${HOME}/$(id)/`id`", 'say "hi"', "back\\slash\\", "two\nlines",
    "it's {all} $x `y` \"z\" \\",
]


@pytest.mark.parametrize("srun", AWKWARD_PATHS)
def test_the_written_nvrx_srun_path_reaches_the_shell_as_it_is(srun: str) -> None:
    """Before: "a b'c" or a } wrote a line that bash refused, or another path."""
    rendered = template_cli.render("train", srun)
    assert subprocess.run(["bash", "-n"], input=rendered, text=True).returncode == 0
    # the lines that set NVRX_SRUN: between the one before them and the one after
    start = rendered.index("\n", rendered.index("export NVRX_SIGNAL_DELAY_S=")) + 1
    setting = rendered[start : rendered.index('if ! command -v "$NVRX_SRUN"', start)]
    script = f'set -euo pipefail\n{setting}printf %s "$NVRX_SRUN"\n'
    base = {"PATH": os.environ["PATH"]}
    for given, expected in ((None, srun), ("", srun), ("/given/nvrx-srun", "/given/nvrx-srun")):
        env = base if given is None else {**base, "NVRX_SRUN": given}
        done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
        assert (done.returncode, done.stdout) == (0, expected), done.stderr


def test_a_template_runs_the_nvrx_srun_at_an_awkward_path(tmp_path: Path) -> None:
    fake = _fake_srun(tmp_path, name=AWKWARD_PATHS[-1].replace("/", "_"))
    script = tmp_path / "train.sbatch"
    script.write_text(template_cli.render("train", str(fake)))
    slurm = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_SUBMIT_DIR": str(tmp_path), "PATH": os.environ["PATH"]}  # fmt: skip
    done = subprocess.run(["bash", str(script), "python", "t.py"], env=slurm, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "args").read_text().splitlines()[-3:] == ["--", "python", "t.py"]


def _signal_recording_srun(tmp_path: Path) -> Path:
    """A stand-in for nvrx-srun that writes each USR1, USR2 and TERM it receives to ``got``
    and exits 143 at TERM; ``ready`` holds its pid once its traps are set."""
    fake = tmp_path / "recording srun"
    fake.write_text(
        "#!/bin/bash\n"
        f'got="{tmp_path}/got"\n'
        "sleep 600 & held=$!\n"  # something to wait on, which a trapped signal interrupts
        'trap \'echo USR2 >> "$got"\' USR2\n'
        'trap \'echo USR1 >> "$got"\' USR1\n'
        'trap \'echo TERM >> "$got"; kill "$held"; exit 143\' TERM\n'
        f'echo $$ > "{tmp_path}/ready.tmp" && mv "{tmp_path}/ready.tmp" "{tmp_path}/ready"\n'
        'while kill -0 "$held" 2>/dev/null; do wait "$held"; done\n'
    )
    fake.chmod(0o755)
    return fake


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (a shell's ``trap``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("given", "signum"), [(None, signal.SIGUSR2), ("USR1", signal.SIGUSR1),
                                               ("sigusr1", signal.SIGUSR1), ("10", signal.SIGUSR1)])
def test_a_template_forwards_the_warning_and_a_stop_to_nvrx_srun(
    tmp_path: Path, name: str, given: str | None, signum: signal.Signals
) -> None:
    """SLURM signals the batch shell (``--signal=B:USR2@N``, ``scancel``): the template passes
    the warning signal, ``$NVRX_PREEMPT_SIGNAL`` as nvrx-srun reads it, on to its nvrx-srun and
    keeps waiting for it, then TERM, and ends with its code. Before: it trapped USR2 alone,
    and another warning signal ended the batch shell."""
    script = tmp_path / f"{name}.sbatch"
    script.write_text(template_cli.render(name, str(_signal_recording_srun(tmp_path))))
    slurm = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
             "SLURM_SUBMIT_DIR": str(tmp_path), "PATH": os.environ["PATH"]}  # fmt: skip
    if given is not None:
        slurm["NVRX_PREEMPT_SIGNAL"] = given
        assert processes.warning_signal(slurm) == signum  # the one nvrx-srun waits for
    shell = subprocess.Popen(["bash", str(script), "true"], env=slurm, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    got, sent = tmp_path / "got", signum.name.removeprefix("SIG")
    try:
        wait_until("the stand-in nvrx-srun to set its traps", (tmp_path / "ready").exists, 30)
        wait_until(f"the template to trap {sent}", lambda: _catches(shell.pid, signum), 30)
        shell.send_signal(signum)
        wait_until(f"{sent} to reach nvrx-srun", lambda: got.exists() and got.read_text() == f"{sent}\n", 30)
        assert shell.poll() is None  # the template waits on for its supervisors
        shell.send_signal(signal.SIGTERM)
        out, _ = shell.communicate(timeout=30)
    finally:
        processes.stop(shell, ask=signal.SIGKILL)
    assert got.read_text() == f"{sent}\nTERM\n"
    assert shell.returncode == 143 and "supervisors ended with exit code 143" in out, out


def _srun_exiting_at_a_signal(tmp_path: Path, code: int) -> Path:
    """A stand-in for nvrx-srun that exits with ``code`` at USR2 or TERM, as the supervisors
    end with their own code (75: checkpointed and requeued); ``ready`` once its traps are set."""
    fake = tmp_path / "exiting srun"
    fake.write_text(
        "#!/bin/bash\n"
        "sleep 600 & held=$!\n"
        f"trap 'kill \"$held\"; exit {code}' USR2 TERM\n"
        f'touch "{tmp_path}/ready"\n'
        'while kill -0 "$held" 2>/dev/null; do wait "$held"; done\n'
    )
    fake.chmod(0o755)
    return fake


#: Bash takes this function from its environment, and a function comes before the builtin of
#: its name: the template's forwarding `kill` returns only once srun has ended and the shell
#: has reaped it, so srun is gone before the template's next command, every time.
KILL_THEN_REAP = (
    '() { builtin kill "$@" || return; '
    'if [ -n "${srun_pid:-}" ] && [ "$1" != -0 ]; then wait "$srun_pid" || true; fi; }'
)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGUSR2, 75), (signal.SIGTERM, 12), (signal.SIGINT, 4)])
def test_a_template_exits_with_srun_s_code_when_a_signal_ends_srun(
    tmp_path: Path, name: str, signum: int, code: int
) -> None:
    """Before: a signal that cut the template's `wait` short, with srun ended before the
    template looked again, made it exit 128+signal (140 for SLURM's warning) instead of
    the supervisors' code."""
    script = tmp_path / f"{name}.sbatch"
    script.write_text(template_cli.render(name, str(_srun_exiting_at_a_signal(tmp_path, code))))
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
           "SLURM_SUBMIT_DIR": str(tmp_path), "PATH": os.environ["PATH"],
           "BASH_FUNC_kill%%": KILL_THEN_REAP}  # fmt: skip
    shell = subprocess.Popen(["bash", str(script), "true"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    wchan = Path(f"/proc/{shell.pid}/wchan")
    try:
        wait_until("the stand-in nvrx-srun to set its traps", (tmp_path / "ready").exists, 30)
        wait_until("the template to trap the signal", lambda: _catches(shell.pid, signum), 30)
        # the signal is to interrupt the template's `wait` (waitpid), not reach it between commands
        wait_until("the template to wait for srun", lambda: wchan.read_text() == "do_wait", 30)
        shell.send_signal(signum)
        out, _ = shell.communicate(timeout=30)
    finally:
        processes.stop(shell, ask=signal.SIGKILL)
    assert shell.returncode == code and f"supervisors ended with exit code {code}" in out, out


#: The template's `wait` returns srun's own code, then, before the template looks at it, a
#: signal arrives (USR2 to itself): the loop waits once more, on a srun bash has reaped.
WAIT_THEN_SIGNAL = (
    '() { builtin wait "$@" && set -- 0 || set -- $?; '
    'if [ -z "${signalled:-}" ]; then signalled=1; builtin kill -USR2 $$; fi; return "$1"; }'
)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("posix", [False, True])
def test_a_signal_after_srun_ended_leaves_srun_s_code(tmp_path: Path, name: str, posix: bool) -> None:
    """Before: in POSIX mode (POSIXLY_CORRECT in the job's environment) bash forgets a child's
    status once `wait` has returned it, so the second `wait` gave 127 and the template exited 127."""
    fake = tmp_path / "srun"
    fake.write_text(f'#!/bin/bash\necho "${{POSIXLY_CORRECT-unset}}" > "{tmp_path}/posix"\nexit 75\n')
    fake.chmod(0o755)
    script = tmp_path / f"{name}.sbatch"
    script.write_text(template_cli.render(name, str(fake)))
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
           "SLURM_SUBMIT_DIR": str(tmp_path), "PATH": os.environ["PATH"],
           "BASH_FUNC_wait%%": WAIT_THEN_SIGNAL} | ({"POSIXLY_CORRECT": "1"} if posix else {})  # fmt: skip
    done = subprocess.run(["bash", str(script), "true"], env=env, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stderr) == (75, ""), done.stdout + done.stderr
    assert done.stdout.endswith("supervisors ended with exit code 75\n"), done.stdout
    assert (tmp_path / "posix").read_text() == ("1\n" if posix else "unset\n")  # srun keeps the user's


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("given", ["WARN", "TERM", "DEBUG", "EXIT"])
def test_a_template_refuses_a_warning_signal_it_cannot_forward(tmp_path: Path, name: str, given: str) -> None:
    """Only USR1 or USR2, as nvrx-srun. Before: the template trapped USR2 whatever
    NVRX_PREEMPT_SIGNAL said; then it refused only what bash cannot trap, and bash traps TERM
    and its own EXIT and DEBUG (with DEBUG, the trap ran before every command, and the template
    waited for srun forever, deaf to TERM)."""
    done = _run(tmp_path, name, ["python", "t.py"], NVRX_PREEMPT_SIGNAL=given)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"nvrx: NVRX_PREEMPT_SIGNAL={given} is not USR1 or USR2: give the one of #SBATCH --signal"
    ]  # fmt: skip
    assert not (tmp_path / "args").exists()  # no nvrx-srun ran


def test_a_template_exits_with_the_supervisors_code(tmp_path: Path) -> None:
    assert _run(tmp_path, "train", ["true"], EXIT="75").returncode == 75


def test_a_template_without_a_command_says_so(tmp_path: Path) -> None:
    done = _run(tmp_path, "train_requeue", [])
    assert done.returncode == 2 and "no training command" in done.stderr


@pytest.mark.parametrize("name", NAMES)
def test_a_template_without_an_nvrx_srun_to_run_says_what_to_fix(tmp_path: Path, name: str) -> None:
    """Before: bash's "No such file or directory", then "supervisors ended with exit code 127",
    though no supervisor had run."""
    missing = str(tmp_path / "no env" / "bin" / "nvrx-srun")
    done = _run(tmp_path, name, ["python", "t.py"], NVRX_SRUN=missing)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"nvrx: no nvrx-srun to run at {missing}: install nvrx where the job runs, set NVRX_SRUN "
        "to its nvrx-srun, or write this script with nvrx-template"
    ]  # fmt: skip
    assert "supervisors ended" not in done.stdout


@pytest.mark.parametrize("name", NAMES)
def test_an_unwritten_template_runs_the_nvrx_srun_on_path_else_the_checkouts(
    tmp_path: Path, name: str
) -> None:
    """Unwritten (``sbatch sbatch_templates/...`` from a checkout), a template runs the
    nvrx-srun on PATH, else bin/nvrx-srun of the submit directory: its check for an
    nvrx-srun to run finds both, and names the second when neither is there."""
    ran = tmp_path / "ran"

    def stand_in(folder: Path) -> Path:
        folder.mkdir(parents=True)
        srun = folder / "nvrx-srun"
        srun.write_text(f'#!/bin/bash\necho "$0" > "{ran}"\n')  # builtins only: PATH is ours
        srun.chmod(0o755)
        return srun

    script = tmp_path / f"{name}.sbatch"
    script.write_text(template_cli.text(name))
    submit = tmp_path / "checkout"
    checkouts, on_path, empty = stand_in(submit / "bin"), stand_in(tmp_path / "venv bin"), tmp_path / "none"
    slurm = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
             "SLURM_SUBMIT_DIR": str(submit)}  # fmt: skip

    def run(path: Path) -> subprocess.CompletedProcess[str]:
        ran.unlink(missing_ok=True)
        return subprocess.run([shutil.which("bash") or "/bin/bash", str(script), "true"],
                              env={**slurm, "PATH": str(path)}, capture_output=True, text=True,
                              timeout=30)  # fmt: skip

    for path, expected in ((on_path.parent, on_path), (empty, checkouts)):
        done = run(path)
        assert done.returncode == 0, done.stderr
        assert ran.read_text() == f"{expected}\n"
    checkouts.unlink()
    done = run(empty)
    assert done.returncode == 2 and f"no nvrx-srun to run at {checkouts}: " in done.stderr
    assert not ran.exists()


def test_the_spare_template_needs_a_training_node(tmp_path: Path) -> None:
    done = _run(tmp_path, "train_spares", ["true"], NVRX_SPARE_NODES="3")
    assert done.returncode == 2 and "NVRX_SPARE_NODES=3 leaves no training node out of 3" in done.stderr


def test_nvrx_template_writes_lists_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    cli = [sys.executable, "-m", "nvrx.slurm.template_cli"]
    done = subprocess.run([*cli, "train_spares", "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    beside = Path(sys.executable).parent / "nvrx-srun"
    assert f'|| NVRX_SRUN={shlex.quote(str(beside.absolute()))}  # written by' in out.read_text()
    again = subprocess.run([*cli, "train_spares", "-o", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "exists: give --force" in again.stderr
    out.write_text("an older job\n")
    forced = subprocess.run([*cli, "train", "-o", str(out), "--force"], capture_output=True, text=True)
    assert forced.returncode == 0 and out.read_text().startswith("#!/bin/bash\n# train.sbatch:")
    listing = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    assert all(name in listing for name in NAMES)
    bad = subprocess.run([*cli, "nosuch"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no template 'nosuch': choose one of train, train_requeue" in bad.stderr


def test_nvrx_srun_builds_one_supervisor_per_node(tmp_path: Path) -> None:
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "PATH": str(tmp_path),
           "NVRX_SRUN_ARGS": "--cpu-bind=none --label"}  # fmt: skip
    command = srun_cli.srun_command(["--nproc-per-node", "2", "--", "python", "t.py"], env, "/py")
    assert command == [
        str(tmp_path / "srun"), "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
        "--kill-on-bad-exit=0", "--no-kill", "--unbuffered", "--cpu-bind=none", "--label",
        "/py", "-m", "nvrx.supervisor", "--nproc-per-node", "2", "--", "python", "t.py",
    ]  # fmt: skip


def test_nvrx_srun_gives_its_step_a_fresh_secret_unless_one_is_set(tmp_path: Path) -> None:
    (tmp_path / "srun").write_text('#!/bin/sh\nprintf %s "$NVRX_JOB_SECRET" > "$0.secret"\n')
    (tmp_path / "srun").chmod(0o755)
    env = {"SLURM_JOB_ID": "7", "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    cli = [sys.executable, "-m", "nvrx.slurm.srun_cli", "--", "python", "t.py"]
    secrets = []
    for given in (None, None, "ab" * MIN_SECRET_BYTES):
        step_env = env if given is None else {**env, "NVRX_JOB_SECRET": given}
        done = subprocess.run(cli, env=step_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        secrets.append((tmp_path / "srun.secret").read_text())
    assert len(parse_secret(secrets[0], "srun's environment")) >= MIN_SECRET_BYTES
    assert secrets[0] != secrets[1] and secrets[2] == "ab" * MIN_SECRET_BYTES


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--", "x"], {}, "not inside a SLURM allocation"),
        (["--nproc-per-node", "2"], {"SLURM_JOB_ID": "1"}, "no training command: put it after '--'"),
        (["--"], {"SLURM_JOB_ID": "1"}, "no training command"),
        (["--", "x"], {"SLURM_JOB_ID": "1", "PATH": "/nonexistent"}, "srun not found on PATH"),
        (["--", "x"], {"SLURM_JOB_ID": "1", "NVRX_SRUN_ARGS": "'open"}, "NVRX_SRUN_ARGS cannot be split"),
    ],
)
def test_nvrx_srun_says_what_to_fix(argv: list[str], env: dict[str, str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nvrx.slurm.srun_cli", *argv],
        env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and message in done.stderr, done.stderr


def _allocation(tmp_path: Path) -> dict[str, str]:
    """The environment of a batch script of a 2-node allocation, with a stand-in srun first on
    PATH that writes its arguments to ``srun.args``; nvrx from this checkout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/srun.args"\n')
    (bin_dir / "srun").chmod(0o755)
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_PROCID": "0", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # fmt: skip


def _nvrx_srun(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nvrx.slurm.srun_cli", *argv], env=_allocation(tmp_path),
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus", "--", "true"], "unrecognized arguments: --bogus (see nvrx-supervise --help)"),
        (["--nproc-per-node", "0", "--", "true"], "--nproc-per-node must be >= 1, got 0"),
        (["--max-restarts", "-1", "--", "true"], "--max-restarts must be >= 0, got -1"),
        (["--spare-nodes", "2", "--", "true"], "--spare-nodes must be in 0..1 (smaller than --nnodes 2"),
    ],
)
def test_nvrx_srun_refuses_what_the_supervisors_would_before_it_runs_srun(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    """Before: srun ran, and each node's supervisor printed the same error once the
    allocation was granted."""
    done = _nvrx_srun(tmp_path, argv)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nvrx-srun: error: {message}"), done.stderr
    assert not (tmp_path / "srun.args").exists()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("NVRX_SIGNAL_DELAY_S", "90s", "NVRX_SIGNAL_DELAY_S='90s' is not a number"),
        ("NVRX_MAX_TIME_LIMIT_REQUEUES", "-1", "NVRX_MAX_TIME_LIMIT_REQUEUES='-1' must not be negative"),
        ("NVRX_PREEMPT_WINDOW_S", "soon", "NVRX_PREEMPT_WINDOW_S='soon' is not a number"),
        ("NVRX_PREEMPT_SIGNAL", "URG", "NVRX_PREEMPT_SIGNAL='URG': the warning signal must be USR1 or "
         "USR2 (the one of sbatch --signal=USR2@SECONDS); TERM, INT and HUP stop the job"),  # a template traps it
    ],
)
def test_nvrx_srun_refuses_a_bad_warning_setting_before_it_runs_srun(
    tmp_path: Path, variable: str, value: str, message: str
) -> None:
    """Before: the check let it pass, srun ran, and every node's supervisor ended with a
    traceback and exit 1 (an internal error) as it started."""
    done = subprocess.run(
        [sys.executable, "-m", "nvrx.slurm.srun_cli", "--", "true"],
        env={**_allocation(tmp_path), variable: value}, cwd=tmp_path, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"nvrx-srun: error: {message}"]
    assert not (tmp_path / "srun.args").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--nproc-per-node", "2", "--max-restarts", "0", "--", "true"],
        ["--nproc-per-node", "gpu", "--spare-nodes", "1", "--", "python", "train.py"],  # counted on each node
        ["--", "./only-on-the-nodes.sh"],  # the nodes' file system is theirs: each node looks
    ],
)
def test_nvrx_srun_runs_srun_with_options_the_supervisors_take(tmp_path: Path, argv: list[str]) -> None:
    done = _nvrx_srun(tmp_path, argv)
    assert done.returncode == 0, done.stderr
    recorded = (tmp_path / "srun.args").read_text().splitlines()
    assert recorded[:2] == ["--nodes=2", "--ntasks=2"]
    assert recorded[recorded.index("nvrx.supervisor") + 1 :] == argv


def test_the_supervisors_check_sees_node_0_of_the_step(tmp_path: Path) -> None:
    """The environment the check runs in is the one srun gives node 0's supervisor: its
    topology is the allocation's, whatever step the batch shell itself is in."""
    from nvrx.supervisor.config import job_from_slurm

    env = {**_allocation(tmp_path), "SLURM_STEP_ID": "4294967294", "SLURM_STEP_NODELIST": "n1",
           "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "1"}  # fmt: skip
    job = job_from_slurm(srun_cli.step_env(env), 1)
    assert (job.nnodes, job.node_rank, job.master_addr) == (2, 0, "n1")
    bare = srun_cli.step_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3"})
    assert job_from_slurm(bare, 1).nnodes == 3  # no node list: stand-in names


def test_nvrx_srun_help_and_the_checkout_wrapper() -> None:
    wrapper = Path(__file__).resolve().parents[2] / "bin" / "nvrx-srun"
    done = subprocess.run([str(wrapper), "--help"], capture_output=True, text=True, check=True)
    assert "--no-kill" in done.stdout and "NVRX_SRUN_ARGS" in done.stdout


def test_nvrx_srun_help_shows_the_srun_line_it_becomes_within_a_terminal(tmp_path: Path) -> None:
    """The srun command --help shows is the one nvrx-srun runs (N nodes, {python}), each of
    its lines within 80 columns, and the pointer to the supervisor's options is a line."""
    block = srun_cli.USAGE.split("then runs\n\n", 1)[1].split("\n\n", 1)[0]
    assert [line for line in block.splitlines() if len(line) > 80] == []
    shown = block.replace("\\\n", " ").split()
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "PATH": str(tmp_path)}
    built = srun_cli.srun_command(["[SUPERVISOR", "OPTIONS]", "--", "COMMAND", "[ARGS...]"], env,
                                  "{python}")  # fmt: skip
    built[:3] = ["srun", "--nodes=N", "--ntasks=N"]
    python = built.index("{python}")
    assert shown == [*built[:python], "$NVRX_SRUN_ARGS", *built[python:]]
    assert "\nSUPERVISOR OPTIONS: nvrx-supervise --help.\n" in srun_cli.USAGE


def test_the_report_finds_the_templates_output_file(tmp_path: Path) -> None:
    (tmp_path / "nvrx-42.out").write_text("x")
    (tmp_path / "nvrx-421.out").write_text("x")
    assert find_output_files("42", [tmp_path]) == [(tmp_path / "nvrx-42.out").resolve()]


@pytest.mark.parametrize("python", ["/bin/false", "/no/such/python"])
def test_a_check_that_cannot_run_warns_and_leaves_the_check_to_the_supervisors(
    tmp_path: Path, python: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A check that crashes, or a Python that is not there, is not the user's usage error:
    srun runs and each supervisor checks for good."""
    from nvrx.slurm.srun_cli import check_supervisor

    check_supervisor(["--nproc-per-node", "1", "--", "true"], _allocation(tmp_path), python=python)
    assert "warning: could not check the supervisor's options" in capsys.readouterr().err
