"""Training-side view of a preemption or time-limit warning: "checkpoint now, then stop".

When SLURM warns a job (``--signal=USR2@N``), the node's supervisor writes one
flag file for the job's current run; training code polls it between steps with
``preemption_requested()`` (one ``stat`` call), saves a checkpoint, and returns.
The supervisor then requeues the job, and the next run resumes from that
checkpoint. A file, not a signal, reaches the children: a signal would kill a
child that installed no handler, and a flag file is visible to every rank of
every node that shares the log directory.

The flag's path is given to children in ``NVRX_PREEMPT_FLAG``; without it, the
path is derived from the job-environment contract (``nvrx.jobenv``: the job's log
directory and ``SLURM_RESTART_COUNT``), so both sides agree without talking.

Importing this module imports no torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nvrx import jobenv
from nvrx.atomic_file import replace_file
from nvrx.events import emit

log = logging.getLogger(__name__)

PREEMPT_FLAG_ENV = jobenv.PREEMPT_FLAG
#: Sub-directory of a job's log directory holding flags, done markers and the requeue ledger.
PREEMPT_DIR = "preempt"


def run_index_from_env(env: Mapping[str, str] | None = None) -> int:
    """Which run of the job this is: ``SLURM_RESTART_COUNT`` (0 for the first run), as the
    supervisor's preemption handler names its flag by (``jobenv.slurm_restart_count``). A bad
    count, which ``nvrx-supervise`` refuses, is run 0 here, with a warning: a rank under
    another launcher still finds a flag."""
    try:
        return jobenv.slurm_restart_count(env)
    except ValueError as exc:
        log.warning("%s; treating this as run 0", exc)
        return 0


def flag_path_for(job_dir: str | os.PathLike[str], run_index: int) -> Path:
    """Path of the preemption flag of run ``run_index`` of the job logging to ``job_dir``."""
    return Path(job_dir) / PREEMPT_DIR / f"r{run_index}.flag"


def flag_path(env: Mapping[str, str] | None = None) -> Path:
    """This process's flag path: ``$NVRX_PREEMPT_FLAG``, else derived from the environment contract."""
    env = os.environ if env is None else env
    given = env.get(PREEMPT_FLAG_ENV)
    if given:
        return Path(given)
    return flag_path_for(jobenv.job_dir(env=env), run_index_from_env(env))


def preemption_requested() -> bool:
    """Whether this job was told to checkpoint and stop (preemption or time limit ahead).

    Cheap enough to call every training step: one ``stat`` of the flag file.
    """
    return flag_path().exists()


def preemption_info() -> dict[str, Any] | None:
    """What the supervisor wrote in the flag (``cause``, ``signal``, ``deadline_wall``); None
    when there is no flag, ``{}`` when one is there but cannot be read as a JSON object."""
    path = flag_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read preemption flag %s: %s", path, exc)
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def record_checkpoint(path: str | os.PathLike[str], step: int | None, action: str = "save") -> None:
    """Write a ``checkpoint`` event (``action`` is ``save`` or ``load``) through the process's
    event writer: the report counts a save against the work lost, and a load as a restore
    only when the writer stamps a round (none unless the code set one: ``update(round=...)``)."""
    if action not in ("save", "load"):
        raise ValueError(f"action must be 'save' or 'load', got {action!r}")
    emit("checkpoint", path=str(path), step=step, action=action)


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (a private temporary file, then rename).

    Several writers (one per node) may race; each rename is atomic, so a reader
    sees either no file or a complete one.
    """
    return replace_file(path, json.dumps(data, default=str))


def write_flag(path: str | os.PathLike[str], info: Mapping[str, Any]) -> Path:
    """Raise the flag: create the flag file (atomically) holding ``info``."""
    return write_json_atomic(path, dict(info))
