"""Child-side entry of ``nvrx.submit`` for a Python callable: ``python -m nvrx.submission.run_callable SPEC``.

``nvrx.submit`` pickles ``(fn, args, kwargs)`` with cloudpickle into a file of
the job folder before submission; each node's supervisor starts this module
once per local rank. It runs the callable and writes the outcome of this rank
to ``$NVRX_RESULT_DIR/rank<RANK>.pkl`` as ``("success", value)`` or
``("error", traceback)`` (atomically), where the node's submitit task collects
it. An exception still ends the process with exit code 1, so the supervisor
restarts the rank as it would any failed training process. A return value that
cannot be pickled is written as the rank's error and ends the process with 130
(``CLEAN_STOP_EXIT``): the supervisor stops the job without a restart, since
running the callable again would return the same. A callable with
submitit's checkpoint method runs under ``checkpointing.CheckpointGuard``: on the
job's warning it is checkpointed (rank 0), the spec file replaced by the call the
next run makes, and the process ends without a result.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from nvrx import jobenv
from nvrx.submission.call_spec import load_spec
from nvrx.submission.checkpointing import CheckpointGuard, CheckpointStop, checkpoint_method
from nvrx.submission.private_files import check_private, write_private
from nvrx.supervisor.exit_codes import CLEAN_STOP_EXIT

RESULT_DIR_ENV = jobenv.RESULT_DIR


def result_path(result_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(result_dir) / f"rank{rank}.pkl"


def write_outcome(result_dir: str | os.PathLike[str], rank: int, outcome: tuple[str, Any]) -> Path:
    """Store one rank's ``(status, value)`` atomically (a reader never sees half a file)."""
    return write_private(result_path(result_dir, rank), cloudpickle.dumps(outcome))


def read_outcome(result_dir: str | os.PathLike[str], rank: int) -> tuple[str, Any] | None:
    """A rank's ``(status, value)``, or None when it wrote none; only a file of the user's
    own is unpickled (``private_files``)."""
    path = result_path(result_dir, rank)
    try:
        check_private(path)
        with open(path, "rb") as fh:
            status, value = cloudpickle.load(fh)
    except FileNotFoundError:
        return None
    return status, value


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m nvrx.submission.run_callable SPEC_FILE", file=sys.stderr)
        return 2
    fn, args, kwargs = load_spec(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    result_dir = os.environ.get(RESULT_DIR_ENV)
    guard = None
    if checkpoint_method(fn) is not None:
        guard = CheckpointGuard(fn, args, kwargs, argv[0], rank)
    try:
        with guard if guard is not None else contextlib.nullcontext():
            value = fn(*args, **kwargs)
    except CheckpointStop:
        # the job was warned: this run ends here, without a result, and runs again or not
        error = guard.error if guard is not None else None
        if error is not None and result_dir:
            write_outcome(result_dir, rank, ("error", "".join(traceback.format_exception(error))))
        return 1 if error is not None else 0
    except Exception:
        if result_dir:
            write_outcome(result_dir, rank, ("error", traceback.format_exc()))
        raise
    if result_dir:
        try:
            data = cloudpickle.dumps(("success", value))
        except Exception as exc:
            # Running the callable again would return the same: stop the job, no restart.
            error = f"cannot pickle the return value of rank {rank} ({type(value).__name__}): {exc!r}"
            write_outcome(result_dir, rank, ("error", error))
            print(f"nvrx.submit: {error}; the job stops without a restart", file=sys.stderr)
            return CLEAN_STOP_EXIT
        write_private(result_path(result_dir, rank), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
