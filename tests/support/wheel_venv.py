"""nvrx as a user installs it: a wheel built by pip from the sources, in a new virtual
environment that does not see the checkout.

The wheel is built the way pip builds one for a user, in an isolated build environment
holding ``pyproject.toml``'s build requirements, from a copy of what a source
distribution holds (an in-place build would write ``build/`` into the checkout). The new
environment gets the wheel alone; the dependencies it declares (no extras: no
submitit) and theirs are borrowed from the test's own environment (torch first: a copy
would cost minutes): a folder of links to their installed files, put on ``sys.path`` by
a path file. Nothing else of that environment is seen: neither the checkout's editable
nvrx nor the test tools, so an undeclared import fails there as it would for a user.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canonical

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
    """nvrx's wheel in ``dist``, built by pip from a copy of the sources in ``src``, with the
    quick start's command (``pip wheel --no-deps -w dist .`` in the checkout)."""
    src.mkdir(parents=True, exist_ok=True)
    dist.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    done = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), "."], src)
    assert done.returncode == 0, tail(done)
    (built,) = dist.glob("nvrx-*.whl")
    return built


def _requirements(dist: metadata.Distribution) -> set[str]:
    """Names of what ``dist`` requires outside its extras, as installed here."""
    names = set()
    for line in dist.requires or ():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.add(req.name)
    return names


def _closure(wheel: Path) -> list[metadata.Distribution]:
    """The installed distributions that the wheel's dependencies need, transitively."""
    with zipfile.ZipFile(wheel) as whl:
        info = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        declared = email.parser.Parser().parsestr(whl.read(info).decode())
    todo = [Requirement(r).name for r in declared.get_all("Requires-Dist") or []
            if Requirement(r).marker is None]  # fmt: skip
    found: dict[str, metadata.Distribution] = {}
    while todo:
        name = canonical(todo.pop())
        if name not in found:
            found[name] = metadata.distribution(name)
            todo.extend(_requirements(found[name]))
    return list(found.values())


def _borrow(folder: Path, wheel: Path) -> Path:
    """A folder of links to the installed files of the wheel's dependencies (and theirs)."""
    folder.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for dist in _closure(wheel):
        for top in {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            if (site / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(site / top)
    return folder


def fresh_venv(home: Path, wheel: Path) -> Path:
    """A new virtual environment at ``home`` with the wheel installed and its declared
    dependencies (no extras) borrowed from this interpreter's environment."""
    done = run([sys.executable, "-m", "venv", str(home)], home.parent)
    assert done.returncode == 0, tail(done)
    python = str(home / "bin" / "python")
    done = run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], home)
    assert done.returncode == 0, tail(done)
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], home)
    borrowed = _borrow(home / "borrowed", wheel)
    Path(site.stdout.strip(), "borrowed_dependencies.pth").write_text(f"{borrowed}\n")
    return home


def venv_env(home: Path) -> dict[str, str]:
    """The environment of a shell with ``home`` activated: nothing of the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVRX_", "PYTHON"))}
    env.update(VIRTUAL_ENV=str(home), PATH=f"{home / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return env
