"""The node agent's program: ``python -m nvrx.node_agent supervised|host ...``.

* ``supervised HOST|- PORT|- TIMEOUT_S [BEATS_FD]``: a supervisor's node agent, which
  serves its supervisor's store requests on stdin and stdout (``supervised``);
* ``host FD``: the agent of a host's Wrapper ranks without a supervisor, on the socket of
  descriptor ``FD``, its ``HostConfig`` as JSON on stdin (``host``).
"""

from __future__ import annotations

import sys

USAGE = "usage: python -m nvrx.node_agent supervised HOST|- PORT|- TIMEOUT_S [BEATS_FD] | host FD"


def main(argv: list[str]) -> int:
    """Run the agent of the mode ``argv[0]`` names with the rest of ``argv``."""
    mode, args = (argv[0], argv[1:]) if argv else ("", [])
    if mode == "supervised":
        from .supervised import main as serve
    elif mode == "host":
        from .host import main as serve
    else:
        print(f"{USAGE}\n(got {' '.join(argv) or 'no arguments'})", file=sys.stderr)
        return 2
    return serve(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
