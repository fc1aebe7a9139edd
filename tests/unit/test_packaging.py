"""What pyproject.toml declares holds: the floors are the tested versions, submitit is optional.

The floors of ``requires-python`` and of the torch dependency are what ``scripts/setup.sh``
installs and the tests run on, so the test run is the run at the lowest versions nvrx
declares. Without submitit (the ``submit`` extra) nvrx, its programs and the Wrapper work,
and ``nvrx.submit`` says how to install it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

from nvrx.submission import MISSING_SUBMITIT
from nvrx.version import __version__

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def release(version: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13): the numbers, trailing zeros dropped, so 2.13 == 2.13.0."""
    numbers = [int(part) for part in version.split("+")[0].split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def floor_of(spec: str, name: str) -> tuple[int, ...]:
    """The X of a plain ``>=X`` specifier; anything else fails, naming the specifier."""
    match = re.fullmatch(r">=\s*(\d+(?:\.\d+)*)", spec.strip())
    assert match, f"{name}: expected a plain floor '>=X.Y', got {spec!r}"
    return release(match[1])


def torch_pin_of_setup() -> str:
    pins = re.findall(r"\btorch==([\d.]+)", (ROOT / "scripts" / "setup.sh").read_text())
    assert len(pins) == 1, f"scripts/setup.sh: one torch==X pin expected, found {pins}"
    return pins[0]


def test_the_torch_floor_is_the_torch_that_setup_installs() -> None:
    torch_deps = [d for d in PROJECT["dependencies"] if re.match(r"torch\b", d)]
    assert len(torch_deps) == 1, f"one torch dependency expected, found {torch_deps}"
    pin = torch_pin_of_setup()
    floor = floor_of(torch_deps[0].removeprefix("torch"), "torch dependency")
    assert floor == release(pin), (
        f"pyproject.toml claims {torch_deps[0]!r} but scripts/setup.sh installs and tests "
        f"torch=={pin}: the floor must be the tested release"
    )
    assert release(torch.__version__) == release(pin), (
        f"the tests run on torch {torch.__version__}, not the floor torch=={pin}"
    )


def test_the_python_floor_is_the_python_the_tests_run_on() -> None:
    floor = floor_of(PROJECT["requires-python"], "requires-python")
    running = sys.version_info[:2]
    assert floor == running, (
        f"requires-python {PROJECT['requires-python']!r}, but the tests run on Python "
        f"{running[0]}.{running[1]}: declare the floor the tests run on"
    )
    classifier = f"Programming Language :: Python :: {running[0]}.{running[1]}"
    assert classifier in PROJECT["classifiers"], f"classifiers lack {classifier!r}"


def test_submitit_is_an_extra_not_a_dependency() -> None:
    assert not [d for d in PROJECT["dependencies"] if d.startswith("submitit")]
    extras = PROJECT["optional-dependencies"]
    assert extras["submit"] == ["submitit"]
    assert "submitit" in extras["dev"], "the tests of nvrx.submit need submitit in dev"


#: Run in a fresh interpreter where ``import submitit`` fails as if it were not installed.
WITHOUT_SUBMITIT = """
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("submitit", "cloudpickle"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())

import nvrx, nvrx.inprocess
from nvrx.report import cli as report_cli
from nvrx.slurm import srun_cli, template_cli
from nvrx.supervisor import cli as supervise_cli

for cli in (supervise_cli, report_cli, srun_cli, template_cli):
    try:
        cli.main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0, (cli.__name__, exc.code)
assert template_cli.main(["train", "-o", sys.argv[1], "--srun", "/x/nvrx-srun"]) == 0
nvrx.inprocess.Wrapper()(lambda: None)
assert nvrx.__version__

for use in ("nvrx.submit", "nvrx.Executor", "__import__('nvrx.submission.submit')"):
    try:
        eval(use)
    except ModuleNotFoundError as exc:
        assert exc.name == "submitit", (use, exc.name)
        print(use, "->", exc)
    else:
        raise AssertionError(f"{use} worked without submitit")
assert "submitit" not in sys.modules
"""


def test_nvrx_works_without_submitit_and_submit_names_the_fix(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_SUBMITIT, str(tmp_path / "job.sbatch")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    versions = [f"nvrx-{p} {__version__}" for p in ("supervise", "report", "srun", "template")]
    uses = ("nvrx.submit", "nvrx.Executor", "__import__('nvrx.submission.submit')")
    assert done.stdout.splitlines() == versions + [f"{use} -> {MISSING_SUBMITIT}" for use in uses]
    assert (tmp_path / "job.sbatch").read_text().startswith("#!/bin/bash")
