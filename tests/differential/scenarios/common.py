"""What every scenario script shares: the implementation it runs, and the record of what a caller sees.

A scenario runs as ``python SCENARIO.py IMPL OUT.json [CASE]`` where ``IMPL`` is ``nvrx``
(``nvrx.inprocess`` / ``nvrx.fault_tolerance``) or ``reference``
(``nvidia_resiliency_ext.inprocess`` / ``.fault_tolerance``); only that import differs.
The record holds outcomes a caller can observe (return values, exception types and
messages, the order and arguments of callbacks, what is left alive after a call) and
never a duration. This module imports neither implementation by itself, so it runs
in either virtual environment.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

PACKAGES = {"nvrx": "nvrx", "reference": "nvidia_resiliency_ext"}
#: The logger name a script written for the reference attaches its handlers to.
REFERENCE_LOGGER = "nvidia_resiliency_ext.inprocess"


def arguments() -> tuple[str, Path, str]:
    """``(IMPL, OUT, CASE)`` from the command line (CASE may be empty); a wrong IMPL names the choices."""
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in PACKAGES:
        raise SystemExit(
            f"usage: {sys.argv[0]} {{{','.join(PACKAGES)}}} OUT.json [CASE], got {sys.argv[1:]}"
        )
    return sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) == 4 else ""


def module(impl: str, name: str) -> Any:
    """``<package of impl>.<name>``: the only place where the two runs differ."""
    return importlib.import_module(f"{PACKAGES[impl]}.{name}")


def write(out: Path, record: dict[str, Any]) -> None:
    out.write_text(json.dumps(record, indent=1, sort_keys=True, default=repr))


def exception_fields(exc: BaseException | None) -> dict[str, Any] | None:
    """Type, message and the types along ``__cause__``: what an ``except`` clause or a
    message match would see."""
    if exc is None:
        return None
    causes = []
    cause = exc.__cause__
    while cause is not None and len(causes) < 8:
        causes.append(type(cause).__name__)
        cause = cause.__cause__
    return {"type": type(exc).__name__, "message": str(exc), "causes": causes}


def state_fields(state: Any) -> dict[str, Any]:
    """The fields of a Wrapper ``State``/``FrozenState`` a callback can read."""
    return {
        "rank": state.rank,
        "world_size": state.world_size,
        "active_rank": state.active_rank,
        "active_world_size": state.active_world_size,
        "initial_rank": state.initial_rank,
        "initial_world_size": state.initial_world_size,
        "iteration": state.iteration,
        "mode": state.mode.name,
        "fn_exception": None if state.fn_exception is None else type(state.fn_exception).__name__,
    }


class CapturingHandler(logging.Handler):
    """A handler as a user attaches one: it keeps the level of each record it receives."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.levels: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.levels.append(record.levelname)


def attach_user_handler(name: str) -> CapturingHandler:
    """A handler on logger ``name`` at INFO, as a user attaches one to the Wrapper's logger."""
    handler = CapturingHandler()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def store_count() -> int:
    """``torch.distributed.Store`` objects alive after a full garbage collection."""
    import torch.distributed as dist

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, dist.Store))


def logger_handlers() -> dict[str, list[str]]:
    """Handler types on every logger that has any (the root included)."""
    loggers = {"<root>": logging.getLogger()}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            loggers[name] = logger
    return {name: sorted(type(h).__name__ for h in lg.handlers) for name, lg in loggers.items() if lg.handlers}


class Leftovers:
    """What a Wrapper call leaves: threads, store objects and logging handlers beyond a baseline."""

    def __init__(self) -> None:
        self.threads = {t.ident for t in threading.enumerate()}
        self.stores = store_count()
        gc.disable()  # so that what the call leaves in a reference cycle shows too
        self.handlers = logger_handlers()

    def after(self) -> dict[str, Any]:
        import torch.distributed as dist

        uncollected = sum(1 for o in gc.get_objects() if isinstance(o, dist.Store))
        gc.enable()
        stores = store_count()
        handlers = logger_handlers()
        added = {
            name: sorted(set(kinds) - set(self.handlers.get(name, [])))
            for name, kinds in handlers.items()
        }
        return {
            "threads": sum(1 for t in threading.enumerate() if t.ident not in self.threads),
            "stores": stores - self.stores,
            "stores_before_collection": uncollected - self.stores,
            "handlers_added": sorted(f"{n}: {k}" for n, ks in added.items() for k in ks),
        }


class StdoutLines:
    """What is written to file descriptor 1 while active (``sys.stdout``, and handlers that
    kept it), kept in ``path`` and copied back to the real stdout at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.saved = -1

    def __enter__(self) -> StdoutLines:
        sys.stdout.flush()
        self.saved = os.dup(1)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.close(fd)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        os.dup2(self.saved, 1)
        os.close(self.saved)
        sys.stdout.write(self.path.read_text(errors="replace"))

    def lines(self) -> list[str]:
        return self.path.read_text(errors="replace").splitlines()


#: What starts a line for NVRx's in-job restarter; the text before it is a timestamp.
RESTARTER_MARK = "[NestedRestarter]"


def restarter_lines(lines: list[str]) -> list[str]:
    """The nested-restarter lines, from their level tag on (``[ALWAYS] [<logger>@<host>:<rank>]
    [NestedRestarter] ...``): the timestamp before it differs from run to run."""
    return [line[line.index("[ALWAYS]"):] for line in lines if RESTARTER_MARK in line and "[ALWAYS]" in line]


def rank_env() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
