"""The call a submitted job runs: ``(fn, args, kwargs)`` pickled with cloudpickle into one file.

``nvrx.submit`` writes it into the job folder before submission; every rank's
``run_callable`` loads it; a checkpoint (``checkpointing``) replaces it with the
call the next run makes. Written owner-only, loaded only when it is the user's own
(``private_files``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from nvrx.submission.private_files import check_private, write_private


def dump_spec(
    path: str | os.PathLike[str],
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> Path:
    """Write what the children will run; raises TypeError naming ``fn`` when it cannot be pickled."""
    try:
        data = cloudpickle.dumps((fn, tuple(args), dict(kwargs)))
    except Exception as exc:
        raise TypeError(f"cannot pickle {fn!r} with its arguments for the job: {exc}") from exc
    return write_private(path, data)


def load_spec(
    path: str | os.PathLike[str],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """What ``dump_spec`` wrote, once ``path`` proved to be the user's own (``private_files``)."""
    check_private(path)
    with open(path, "rb") as fh:
        fn, args, kwargs = cloudpickle.load(fh)
    return fn, args, kwargs
