"""srun's ``--export`` as ``nvrx-srun`` widens it (``nvrx.slurm.srun_export``): the supervisors
get nvrx's variables whatever ``--export`` the user gives srun.

What srun itself does with each value (SLURM 22.05.8) is in the module's docstring; a real
srun under a real ``sbatch --export=NONE`` runs in ``tests/slurm/test_preemption.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx.slurm import srun_cli
from nvrx.slurm.srun_export import ExportError, passed_names, widened, with_names_exported

REPO = Path(__file__).resolve().parents[2]
OWN = ["NVRX_JOB_SECRET", "NVRX_WARNED_AT"]
NAMES = ["NVRX_JOB_SECRET", "NVRX_LOG_DIR", "NVRX_PREEMPT_SIGNAL", "NVRX_WARNED_AT"]


def test_the_names_are_nvrx_srun_s_own_and_every_nvrx_variable_there() -> None:
    env = {"NVRX_PREEMPT_SIGNAL": "USR1", "NVRX_LOG_DIR": "/logs", "PATH": "/bin", "XNVRX_": "1"}
    assert passed_names(env) == NAMES
    assert passed_names({}) == OWN  # set just before the exec: named all the same


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("NONE", ",".join(NAMES)),  # NONE takes no names: a list of none but ours is NONE and ours
        ("none,PATH", ",".join(NAMES)),  # srun drops what follows NONE
        ("", ",".join(NAMES)),  # SLURM's variables alone, as NONE
        ("PATH,HOME", ",".join(["PATH", "HOME", *NAMES])),
        ("PATH,,HOME,", ",".join(["PATH", "HOME", *NAMES])),
        ("NVRX_LOG_DIR=/mine,PATH", "NVRX_LOG_DIR=/mine,PATH,NVRX_JOB_SECRET,NVRX_PREEMPT_SIGNAL,NVRX_WARNED_AT"),
        ("PATH,NONE,HOME", ",".join(["PATH", *NAMES])),  # srun reads no item past NONE
        ("NONE,ALL", ",".join(NAMES)),  # nor an ALL past it
        ("ALL,NONE", None),
        ("ALL", None),
        ("all,PATH", None),
        ("PATH,ALL", None),
    ],
)
def test_an_export_value_is_widened_to_pass_the_names(value: str, expected: str | None) -> None:
    assert widened(value, NAMES) == expected


ENV = {"NVRX_LOG_DIR": "/logs"}
WIDE = "--export=" + ",".join(["NVRX_JOB_SECRET", "NVRX_LOG_DIR", "NVRX_WARNED_AT"])


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ([], ENV, []),
        (["--cpu-bind=none"], {**ENV, "SLURM_EXPORT_ENV": "NONE"}, ["--cpu-bind=none", WIDE]),
        (["--export=NONE", "--label"], ENV, [WIDE, "--label"]),
        (["--export", "NONE", "--label"], ENV, [WIDE, "--label"]),
        (["--exp=NONE"], ENV, [WIDE]),  # srun takes an unambiguous beginning of --export
        (["--export=PATH", "--export=NONE"], ENV, ["--export=PATH", WIDE]),  # the last one counts
        (["--export=ALL"], {**ENV, "SLURM_EXPORT_ENV": "NONE"}, ["--export=ALL"]),  # it wins
        (["--export=PATH"], {**ENV, "SLURM_EXPORT_ENV": "ALL"}, [WIDE.replace("=", "=PATH,", 1)]),
        (["--exclusive", "--extra-node-info=1"], ENV, ["--exclusive", "--extra-node-info=1"]),
    ],
)
def test_the_export_srun_follows_is_the_one_widened(
    args: list[str], env: dict[str, str], expected: list[str]
) -> None:
    assert with_names_exported(args, env) == expected


def test_an_export_without_its_value_is_refused() -> None:
    with pytest.raises(ExportError, match="--export ends NVRX_SRUN_ARGS without its value"):
        with_names_exported(["--label", "--export"], ENV)


def _allocation(tmp_path: Path, **env: str) -> dict[str, str]:
    """A batch script's environment of a 2-node allocation, with a stand-in srun first on PATH
    that writes its arguments to ``srun.args``; nvrx from this checkout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/srun.args"\n')
    (bin_dir / "srun").chmod(0o755)
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO),
            **env}  # fmt: skip


@pytest.mark.parametrize(
    ("given", "export"),
    [
        ({"NVRX_SRUN_ARGS": "--export=PATH,HOME --label"}, "PATH,HOME,"),
        ({"SLURM_EXPORT_ENV": "NONE"}, ""),  # what sbatch --export=NONE leaves the batch script
    ],
)
def test_nvrx_srun_names_nvrx_s_variables_in_a_restrictive_export(
    tmp_path: Path, given: dict[str, str], export: str
) -> None:
    """Before: srun ran with the user's --export alone, and the supervisors had neither the
    job's secret nor the warning that came before srun ran, nor the warning signal's name.
    The secret itself is never on srun's command line: srun reads it from its environment."""
    env = _allocation(tmp_path, NVRX_PREEMPT_SIGNAL="USR1", **given)
    done = subprocess.run(
        [sys.executable, "-m", "nvrx.slurm.srun_cli", "--", "true"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    exports = [a for a in args if a.startswith("--export")]
    names = ["NVRX_JOB_SECRET", "NVRX_PREEMPT_SIGNAL", "NVRX_WARNED_AT"]
    if "NVRX_SRUN_ARGS" in given:
        names.insert(2, "NVRX_SRUN_ARGS")
    assert exports == [f"--export={export}{','.join(names)}"]
    assert args.index(exports[0]) < args.index("nvrx.supervisor")  # an option of srun's


def test_nvrx_srun_refuses_an_export_without_its_value(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nvrx.slurm.srun_cli", "--", "true"],
        env=_allocation(tmp_path, NVRX_SRUN_ARGS="--label --export"), cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "nvrx-srun: error: --export ends NVRX_SRUN_ARGS without its value: give "
        "--export=NAME,... (or ALL)"
    ]  # fmt: skip
    assert not (tmp_path / "srun.args").exists()


def test_the_srun_command_keeps_an_export_that_passes_everything(tmp_path: Path) -> None:
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    env = {"SLURM_JOB_ID": "7", "PATH": str(tmp_path), "NVRX_SRUN_ARGS": "--export=ALL,X=1",
           "SLURM_EXPORT_ENV": "NONE"}  # fmt: skip
    command = srun_cli.srun_command(["--", "true"], env, "/py")
    assert [a for a in command if a.startswith("--export")] == ["--export=ALL,X=1"]
