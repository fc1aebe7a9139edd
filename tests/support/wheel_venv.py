"""nvrx as a user installs it: a wheel built by pip from the sources, in a new virtual
environment that does not see the checkout.

The wheel is built the way pip builds one for a user, in an isolated build environment
holding ``pyproject.toml``'s build requirements, from a copy of what a source
distribution holds (an in-place build would write ``build/`` into the checkout). The new
environment gets the wheel alone; its dependencies (torch first: a copy would cost
minutes) are borrowed from the test's own environment: a folder of links to what that
environment installed, less nvrx's editable install and whatever the caller leaves out
(submitit, to show nvrx without it), put on ``sys.path`` by a path file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What a source distribution of nvrx holds: all the wheel is built from.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "nvrx")


def run(
    cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def tail(done: subprocess.CompletedProcess[str], chars: int = 3000) -> str:
    """A finished command and the end of its output, for an assertion message."""
    args = " ".join(map(str, done.args))
    return f"exit {done.returncode}: {args}\n{(done.stdout + done.stderr)[-chars:]}"


def build_wheel(src: Path, dist: Path) -> Path:
    """nvrx's wheel in ``dist``, built by pip from a copy of the sources in ``src``."""
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    # An absolute path: a bare name is taken for a package of the index.
    done = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(src)], dist)
    assert done.returncode == 0, tail(done)
    (built,) = dist.glob("nvrx-*.whl")
    return built


#: What of the test's environment is never borrowed: the checkout's editable nvrx.
OWN = ("nvrx", "__editable__")


def _borrow(folder: Path, leave_out: tuple[str, ...]) -> Path:
    """A folder of links to this environment's installed packages, less ``leave_out``."""
    folder.mkdir()
    skip = tuple(name.lower() for name in (*OWN, *leave_out))
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower().replace("-", "_")
        if not name.startswith(skip) and entry.suffix != ".pth":
            (folder / entry.name).symlink_to(entry)
    return folder


def fresh_venv(home: Path, wheel: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """A new virtual environment at ``home`` with the wheel installed and the dependencies
    borrowed from this interpreter's environment, less the packages named in ``leave_out``."""
    done = run([sys.executable, "-m", "venv", str(home)], home.parent)
    assert done.returncode == 0, tail(done)
    python = str(home / "bin" / "python")
    done = run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], home)
    assert done.returncode == 0, tail(done)
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], home)
    borrowed = _borrow(home / "borrowed", leave_out)
    Path(site.stdout.strip(), "borrowed_dependencies.pth").write_text(f"{borrowed}\n")
    return home


def venv_env(home: Path) -> dict[str, str]:
    """The environment of a shell with ``home`` activated: nothing of the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVRX_", "PYTHON"))}
    env.update(VIRTUAL_ENV=str(home), PATH=f"{home / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return env
