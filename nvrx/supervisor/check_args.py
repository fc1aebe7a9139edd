"""``python -m nvrx.supervisor.check_args [OPTIONS] -- COMMAND``: whether ``nvrx-supervise``
takes these options and this command in this environment, without starting anything.

``nvrx-srun`` runs it before ``srun``, in the environment node 0's supervisor will have
under srun: a bad option then ends in one line, before the job step starts, not in one
identical error per node once the allocation was granted. Exit 0 when they are taken;
2 (``ExitCode.USAGE``) with the supervisor's message, alone on stderr, when not. What the
parse says besides (a port pair picked) is not shown: the supervisors say it again.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Sequence

from .cli import config_from_args
from .config import ConfigError
from .exit_codes import ExitCode


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            config_from_args(argv, count_here=False)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return ExitCode.USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
