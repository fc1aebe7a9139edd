"""``nvrx-template``: write one of nvrx's sbatch templates, filled in for this environment.

The templates ship inside the package (``nvrx/slurm/sbatch/``; ``sbatch_templates/`` of a
checkout is the same folder). Written by this command, a template runs the ``nvrx-srun``
of the environment the command runs from, by its absolute path, so the job needs no
checkout and no activated environment: ``nvrx-template train -o train.sbatch``, then
``sbatch train.sbatch python train.py``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from nvrx.help_format import HelpFormatter
from nvrx.version import __version__

PROG = "nvrx-template"
#: The line of each template that this command fills in ends with this marker.
SRUN_MARKER = "# nvrx-template: NVRX_SRUN"
SUFFIX = ".sbatch"


def names() -> list[str]:
    """The templates shipped with nvrx: ``train``, ``train_requeue``, ``train_spares``."""
    folder = resources.files("nvrx.slurm") / "sbatch"
    return sorted(p.name[: -len(SUFFIX)] for p in folder.iterdir() if p.name.endswith(SUFFIX))


def text(name: str) -> str:
    """The template ``name`` as shipped; ValueError names the templates there are."""
    if name not in names():
        raise ValueError(f"no template {name!r}: choose one of {', '.join(names())}")
    return (resources.files("nvrx.slurm") / "sbatch" / f"{name}{SUFFIX}").read_text()


def summary(name: str) -> str:
    """The template's first comment line after its name: what it is for."""
    second = text(name).splitlines()[1]
    return second.split(":", 1)[-1].strip() if ":" in second else second.lstrip("# ")


def render(name: str, srun: str) -> str:
    """The template ``name`` running the ``nvrx-srun`` at ``srun`` unless NVRX_SRUN says otherwise."""
    lines = text(name).splitlines(keepends=True)
    marked = [i for i, line in enumerate(lines) if line.rstrip().endswith(SRUN_MARKER)]
    if len(marked) != 1:
        raise ValueError(f"template {name!r} has {len(marked)} lines marked {SRUN_MARKER!r}, not 1")
    # Quoted whole for the shell (spaces, quotes, $, `, } and backslashes stay themselves), outside
    # any ${...}: there a } would end the expansion, and a ' open a quote of its own.
    lines[marked[0]] = (
        f'[ -n "${{NVRX_SRUN:-}}" ] || NVRX_SRUN={shlex.quote(srun)}  # written by {PROG} {__version__}\n'
    )
    return "".join(lines)


def srun_path(given: str | None) -> str:
    """The nvrx-srun the job is to run: ``--srun``, else this environment's (``this_srun``);
    ValueError for an empty ``--srun``, which names none."""
    if given is None:
        return this_srun()
    if not given.strip():
        raise ValueError(
            f"--srun {given!r} names no nvrx-srun: give its path, or leave --srun out for "
            "this environment's"
        )
    return given


def this_srun() -> str:
    """The ``nvrx-srun`` of this environment: next to its Python, else on PATH."""
    beside = Path(sys.executable).parent / "nvrx-srun"
    if beside.is_file():
        return str(beside.absolute())
    found = shutil.which("nvrx-srun")
    if found is None:
        raise ValueError(
            f"no nvrx-srun next to {sys.executable} nor on PATH: install nvrx into this "
            "environment (pip install a wheel or a checkout of nvrx), or give --srun PATH"
        )
    return str(Path(found).absolute())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage="%(prog)s [NAME] [-o FILE] [--force] [--srun PATH]",  # one line, whatever the width
        description="Write an nvrx sbatch template, filled in with the nvrx-srun of this "
        "environment (by absolute path), to a file or stdout. Without NAME: list them.",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help="the template: " + ", ".join(names()))
    parser.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    parser.add_argument(
        "--srun", metavar="PATH", help="the nvrx-srun the job runs (default: this environment's)"
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return parser


def srun_warning(srun: str) -> str | None:
    """A warning when ``--srun`` names no executable file here: it may still be one on the
    cluster's nodes, where the job runs it, so the template is written all the same."""
    if os.path.isfile(srun) and os.access(srun, os.X_OK):
        return None
    return (
        f"--srun {srun} is not an executable file on this machine: the job runs it on the "
        "cluster's nodes, where it must be one"
    )


def write(out: Path, filled: str, force: bool) -> None:
    """The template to ``out``; ValueError (a usage error) for a file there without ``force``,
    OSError naming the file, and the folder when that is what is missing."""
    if out.exists() and not force:
        raise ValueError(f"{out} exists: give --force to overwrite it, or another -o FILE")
    if not out.parent.is_dir():
        raise OSError(
            f"cannot write {out}: folder {out.parent} does not exist (create it, or give "
            "another -o FILE)"
        )
    try:
        out.write_text(filled)
    except OSError as exc:
        raise OSError(f"cannot write {out}: {exc.strerror or exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: 0 on success, 2 on a usage error, 1 when the file cannot be
    written (the message says what to fix)."""
    args = build_parser().parse_args(argv)
    if args.name is None:
        for name in names():
            print(f"{name:15s} {summary(name)}")
        print(f"\n{PROG} NAME -o FILE writes one; then: sbatch FILE COMMAND [ARGS...]")
        return 0
    try:
        srun = srun_path(args.srun)
        filled = render(args.name, srun)
        warning = srun_warning(srun) if args.srun is not None else None
        if warning:
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
        if args.output is None:
            sys.stdout.write(filled)
            return 0
        out = Path(args.output)
        write(out, filled, args.force)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(f"{PROG}: wrote {out} (runs {srun}); submit: sbatch {out} COMMAND [ARGS...]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
