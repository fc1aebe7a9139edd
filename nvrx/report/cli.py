"""``nvrx-report``: what happened in a job, from its event logs (and SLURM when available)."""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from nvrx import jobenv
from nvrx.help_format import HelpFormatter
from nvrx.version import __version__

from .build import build_report
from .loading import ReportError
from .render import FORMATS
from .render_html import HTML
from .text_doc import MIN_TEXT_WIDTH, TEXT_WIDTH

EXIT_OK = 0
EXIT_CANNOT_WRITE = 1
_RELATIVE = re.compile(r"^(?P<n>\d+(\.\d+)?)(?P<unit>[smhd])$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: epoch seconds, an ISO date/time (UTC unless it says otherwise), or ``30m``/``2h`` ago."""
    value = text.strip()
    match = _RELATIVE.match(value)
    if match:
        return (time.time() if now is None else now) - float(match["n"]) * _UNIT_S[match["unit"]]
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--since {text!r}: expected epoch seconds, an ISO time like 2024-05-01T12:00:00, or 30m/2h/1d"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _width(text: str) -> int:
    """``--width``: 0 (no limit) or at least ``MIN_TEXT_WIDTH`` characters."""
    value = int(text) if text.strip().isdecimal() and text.isascii() else -1
    if value != 0 and value < MIN_TEXT_WIDTH:
        raise argparse.ArgumentTypeError(
            f"--width must be 0 (no limit) or at least {MIN_TEXT_WIDTH}, got {text!r}"
        )
    return value


def _workers(text: str) -> int:
    """``--workers``: a number of processes, at least 1."""
    value = int(text) if text.strip().isdecimal() and text.isascii() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"--workers must be a number of processes, at least 1, got {text!r}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nvrx-report",
        usage="%(prog)s [options] [LOG_DIR]",  # one line above a usage error, whatever the width
        description="Summarize a job's nvrx events: restarts, first failing rank, failures, hangs, suspect nodes.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"nvrx-report {__version__}")
    p.add_argument(
        "log_dir",
        nargs="?",
        default=None,
        metavar="LOG_DIR",
        help="the job's event directory, or the base holding one per job "
        f"(default: ${jobenv.LOG_DIR} or ./{jobenv.DEFAULT_LOG_DIR})",
    )
    p.add_argument(
        "--job", default=None, metavar="JOBID", help="job to report on when LOG_DIR holds several"
    )
    p.add_argument(
        "--format",
        choices=(*FORMATS, HTML),
        default="table",
        help="output format (default: table); html: one self-contained page (no network) with "
        "the tables and a timeline of every rank (training, restarts, dead, hung, spare and "
        "requeue periods, each fault a click away from its traceback); write it with -o FILE",
    )
    _add_filters(p)
    _add_sources(p)
    _add_output(p)
    return p


def _add_filters(p: argparse.ArgumentParser) -> None:
    """Which events the report reads: one rank, one node, from a time on."""
    p.add_argument(
        "--rank", type=int, default=None, metavar="R", help="only events of global rank R"
    )
    p.add_argument(
        "--node",
        type=int,
        default=None,
        metavar="N",
        help="only events whose node is N: the node rank in a rank's events, the slot in a "
        "supervisor's (a spare keeps its slot after it takes a node rank over)",
    )
    p.add_argument(
        "--since", type=parse_since, default=None, metavar="T", help="only events at or after T"
    )


def _add_sources(p: argparse.ArgumentParser) -> None:
    """What else the report reads: SLURM's and submitit's output files."""
    p.add_argument(
        "--slurm-output",
        nargs="+",
        default=[],
        metavar="PATH",
        help="job stdout/stderr files to scan for tracebacks and fatal signals (slurm-<job>.out and nvrx-<job>.out are found by themselves)",
    )
    p.add_argument(
        "--submitit-folder",
        action="append",
        default=[],
        metavar="DIR",
        help="submitit folder holding <job>_<task>_log.out/err files (repeatable)",
    )


def _add_output(p: argparse.ArgumentParser) -> None:
    """How the report reads and writes: sacct, workers, width, the output file."""
    p.add_argument("--no-sacct", action="store_true", help="do not ask sacct")
    p.add_argument(
        "--workers",
        type=_workers,
        default=None,
        metavar="N",
        help="processes reading event files, at least 1 (default: CPUs, at most 8)",
    )
    p.add_argument(
        "--width",
        type=_width,
        default=TEXT_WIDTH,
        metavar="N",
        help=f"widest line of the table format, its cells wrapped to fit (default: {TEXT_WIDTH}; "
        "0: no limit)",
    )
    p.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="write the report to FILE instead of stdout (with --format html: the page to open "
        "in a browser, e.g. -o report.html)",
    )


class _OneLine(logging.Formatter):
    """``nvrx-report: warning: ...``: the form docs/conventions.md gives a command-line
    program's warnings (a traceback, where a record has one, follows it)."""

    def __init__(self) -> None:
        super().__init__("nvrx-report: %(level)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.level = record.levelname.lower()
        return super().format(record)


def main(argv: Sequence[str] | None = None) -> int:
    """Print (or write, -o) the report; exit 2 when there is nothing to read (or --job/--rank/
    --node name nothing there), 1 when the log directory cannot be read or -o FILE cannot be
    written."""
    args = _parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_OneLine())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    try:
        report = build_report(
            args.log_dir,
            args.job,
            rank=args.rank,
            node=args.node,
            since=args.since,
            sacct=not args.no_sacct,
            slurm_output=args.slurm_output,
            submitit_folders=args.submitit_folder,
            workers=args.workers,
            progress=sys.stderr,  # shown only when stderr is a terminal
        )
    except ReportError as exc:
        print(f"nvrx-report: {exc}", file=sys.stderr)
        return exc.exit_code
    text = report.to_text(args.format, width=args.width or None)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            print(
                f"nvrx-report: cannot write the report to -o {args.output!r}: "
                f"{exc.strerror or exc} (does its directory exist, may you write there?)",
                file=sys.stderr,
            )
            return EXIT_CANNOT_WRITE
    else:
        sys.stdout.write(text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
