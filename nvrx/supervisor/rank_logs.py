"""Where each training process's output and error file go: torchrun's ``--redirects``,
``--tee`` and ``--local-ranks-filter``, with torchrun's meaning.

Every start of a child gets a directory of its own under the job's log
directory, ``ranks/rank<R>/attempt<A>-slot<S>-<supervisor>/`` (``<supervisor>``:
a token of the supervisor process, new in each run of a requeued job): its
``error.json`` (``TORCHELASTIC_ERROR_FILE``, written by torch's ``@record``),
and ``stdout.log``/``stderr.log`` for the streams that are redirected or
tee'd. A redirected stream goes only to its file; a tee'd one to its file
and to the supervisor's console, each line prefixed (``[default0]:`` by
default, as torchrun does). ``--local-ranks-filter`` keeps the console to the
listed local ranks; the files are written whatever it says.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import string
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nvrx.jobenv import TORCHRUN_ROLE

log = logging.getLogger(__name__)

#: torch's ``@record`` writes the error of a failed process to the file this names.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: torchrun's variable for the line prefix of tee'd output (``${role_name}``, ``${local_rank}``, ``${rank}``).
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
DEFAULT_PREFIX_TEMPLATE = "[${role_name}${local_rank}]:"
RANKS_DIR = "ranks"
ERROR_FILE = "error.json"
STREAM_FILES = {"stdout": "stdout.log", "stderr": "stderr.log"}


class Std(enum.IntFlag):
    """Streams of a process, as torchrun numbers them: 0 none, 1 stdout, 2 stderr, 3 both."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


class Route(enum.Enum):
    """Where one stream of one process goes."""

    CONSOLE = "console"  # the supervisor's own stream, unprefixed (nothing redirected)
    FILE = "file"  # its log file only
    TEE = "tee"  # its log file, and the console with a prefix
    NULL = "null"  # nowhere: a local rank the console filter leaves out


def parse_std(value: str, option: str) -> Std | dict[int, Std]:
    """``"3"`` -> Std.ALL; ``"0:1,1:2"`` -> per local rank. ValueError names ``option``."""
    text = value.strip()
    bad = ValueError(
        f"{option} must be 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or LOCAL_RANK:0-3,... "
        f"(e.g. 0:3,1:2), got {value!r}"
    )
    if text.isdigit() and len(text) == 1:
        if int(text) > 3:
            raise bad
        return Std(int(text))
    per_rank: dict[int, Std] = {}
    for part in text.split(","):
        rank, _, std = part.strip().partition(":")
        if not (rank.isdigit() and std.isdigit() and len(std) == 1 and int(std) <= 3):
            raise bad
        per_rank[int(rank)] = Std(int(std))
    return per_rank


def parse_ranks_filter(value: str) -> frozenset[int] | None:
    """``"0,2"`` -> {0, 2}; empty -> None (every local rank on the console)."""
    if not value.strip():
        return None
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(
            f"--local-ranks-filter must be a comma-separated list of local ranks, e.g. 0,1, got {value!r}"
        )
    return frozenset(int(p) for p in parts)


def _of(spec: Std | dict[int, Std], local_rank: int) -> Std:
    return spec.get(local_rank, Std.NONE) if isinstance(spec, dict) else spec


@dataclass(frozen=True)
class RankLogs:
    """The output settings of one supervisor (``--redirects``, ``--tee``, ``--local-ranks-filter``)."""

    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    console_ranks: frozenset[int] | None = None
    prefix_template: str = DEFAULT_PREFIX_TEMPLATE

    @classmethod
    def from_options(
        cls, redirects: str, tee: str, ranks_filter: str, env: Mapping[str, str] | None = None
    ) -> RankLogs:
        """Settings from the options' text; ValueError names the option to fix."""
        env = os.environ if env is None else env
        return cls(
            parse_std(redirects, "--redirects"),
            parse_std(tee, "--tee"),
            parse_ranks_filter(ranks_filter),
            env.get(PREFIX_TEMPLATE_ENV) or DEFAULT_PREFIX_TEMPLATE,
        )

    def routes(self, local_rank: int) -> tuple[Route, Route]:
        """Where stdout and stderr of ``local_rank``'s process go."""
        redirected = _of(self.redirects, local_rank) | _of(self.tee, local_rank)
        tee = _of(self.tee, local_rank)
        shown = self.console_ranks is None or local_rank in self.console_ranks
        out: list[Route] = []
        for std in (Std.OUT, Std.ERR):
            if std in tee:
                out.append(Route.TEE if shown else Route.FILE)
            elif std in redirected:
                out.append(Route.FILE)
            else:
                out.append(Route.CONSOLE if shown else Route.NULL)
        return out[0], out[1]

    def prefix(self, local_rank: int, rank: int | None) -> bytes:
        """The line prefix of a tee'd line; as torchrun, a ``$name`` it does not know stays."""
        text = string.Template(self.prefix_template).safe_substitute(
            role_name=TORCHRUN_ROLE,
            local_rank=local_rank,
            rank=local_rank if rank is None else rank,
        )
        return text.encode(errors="replace")


_token: tuple[int, str] | None = None


def supervisor_token() -> str:
    """This process's part of its children's directory names: its pid and a random suffix, so
    that a requeued run (the same job, perhaps the same pid) never reuses a directory."""
    global _token
    if _token is None or _token[0] != os.getpid():
        _token = (os.getpid(), f"p{os.getpid()}-{uuid.uuid4().hex[:6]}")
    return _token[1]


def rank_dir(job_dir: Path, rank: int, attempt: int, slot: int) -> Path:
    """The directory of one start of one rank's process by this supervisor."""
    name = f"attempt{attempt}-slot{slot}-{supervisor_token()}"
    return job_dir / RANKS_DIR / f"rank{rank}" / name


def prepare_dir(job_dir: Path, rank: int, attempt: int, slot: int) -> Path | None:
    """Make ``rank_dir`` for a process about to start; None (logged) when it cannot be made."""
    directory = rank_dir(job_dir, rank, attempt, slot)
    try:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileNotFoundError:  # a parent left empty was removed meanwhile (``error_file``)
            directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("cannot make %s: %s (no error file, no log files)", directory, exc)
        return None
    return directory


def error_file(directory: Path | None, job_dir: Path) -> str | None:
    """The error file an ended process wrote (relative to ``job_dir``), or None; a directory
    left empty (no error, no routed stream) is removed, and so are its parents left empty."""
    if directory is None:
        return None
    path = directory / ERROR_FILE
    with contextlib.suppress(OSError):
        if path.stat().st_size > 0:
            return str(path.relative_to(job_dir))
    for empty in (directory, directory.parent, directory.parent.parent):  # attempt, rank, ranks
        try:
            empty.rmdir()
        except OSError:  # not empty: another start's files, kept
            break
    return None
