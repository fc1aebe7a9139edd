"""What a supervisor does with its ranks' workload-control requests (``WorkloadControl``)."""

from __future__ import annotations

import socket

import pytest

from nvrx.supervisor.exit_codes import ExitCode
from nvrx.supervisor.rank_watch import Watched
from nvrx.supervisor.workload_control import WorkloadControl


class _Control:
    """What ``WorkloadControl`` uses of the supervisor's ``NodeControl``: its events and stops."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.stops: list[tuple[str, int, bool]] = []

    def emit(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))

    def request_stop(self, reason: str, exit_code: int, broadcast: bool) -> None:
        self.stops.append((reason, exit_code, broadcast))


@pytest.mark.parametrize(
    ("request_", "stop"),
    [
        ({"action": "Continue", "description": "all well"}, None),
        ({"action": "ShutdownWorkload", "description": "done early"},
         ("rank 3 asked to shut the workload down: done early", ExitCode.OK, True)),
        ({"action": "ExcludeThisNode", "description": "bad GPU"},
         ("rank 3 asked to exclude this node: bad GPU", ExitCode.EXCLUDED, False)),
        ({"action": "Reboot"}, None),
        (["not", "a", "request"], None),
    ],
    ids=["continue", "shutdown", "exclude", "unknown", "malformed"],
)  # fmt: skip
def test_each_request_is_an_event_and_only_shutdown_and_exclude_stop(request_, stop) -> None:
    control = _Control()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        rank = Watched(sock, local_rank=1, rank=3, pid=4321)
        WorkloadControl(store=None, control=control, ranks=None).on_control(rank, request_)  # type: ignore[arg-type]
    [(kind, fields)] = control.events
    assert (kind, fields["rank"], fields["local_rank"], fields["child_pid"]) == ("workload_control", 3, 1, 4321)
    assert control.stops == ([] if stop is None else [stop])
