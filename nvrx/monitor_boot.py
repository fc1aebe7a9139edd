"""The first steps of a Wrapper's monitor process, before it imports the rest of nvrx.

The monitor program (``nvrx.inprocess.monitor_main``) imports no torch: its link
to the store is nvrx's own client (``nvrx.store.wire``). A monitor that hosts the
job's store (the Wrapper without a supervisor, ``tcp_store_host_rank``) launches
the store service first, which imports torch, and imports its own modules while
the service starts, rather than after it. This module imports neither torch nor
``nvrx.inprocess``; both entry points of the program
are here, so that a monitor process is told by this module's name in its
command line (``PROGRAM``).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, NoReturn

from nvrx import processes

if TYPE_CHECKING:
    from nvrx.store.service import StoreService

#: What every monitor process's command line contains.
PROGRAM = "nvrx.monitor_boot"
#: A program started ahead says so once its imports are done (``monitor_process.prestart``).
IMPORTED_LINE = '{"imported": true}\n'


def main() -> NoReturn:
    """The program's entry point: read the configuration, launch the store it hosts, watch."""
    processes.ignore_warning_signal()  # first: SLURM's warning signal would end the program
    line = sys.stdin.buffer.readline()
    early: StoreService | BaseException | None
    try:
        early = launch_store(line)
    except Exception as exc:  # raised by the program, where it is logged
        early = exc
    from nvrx.inprocess.monitor_main import main as watch

    processes.exit_now(watch(line, early))


def main_prestarted() -> NoReturn:
    """Entry point of a program started ahead of its rank: its imports first (those of its
    link to the store too), then the rest."""
    processes.ignore_warning_signal()
    from nvrx.inprocess import monitor_store
    from nvrx.inprocess.monitor_main import main as watch

    monitor_store.preload()

    sys.stdout.write(IMPORTED_LINE)
    sys.stdout.flush()
    processes.exit_now(watch())


def launch_store(line: bytes) -> StoreService | None:
    """Launch the store service the configuration ``line`` asks this monitor to host, if any;
    ``StoreService.wait_started`` then waits until it serves."""
    if not line.strip():
        return None
    cfg = json.loads(line)
    if not cfg.get("host_store"):
        return None
    from nvrx.store.service import StoreService

    host, port = cfg.get("store_host") or "127.0.0.1", int(cfg.get("store_port") or 0)
    return StoreService(host, port, node=None).launch()
