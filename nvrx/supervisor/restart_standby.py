"""A warm standby for process restarts, kept by one part of the supervisor.

A restarted rank's first second or more goes to a fresh interpreter importing
torch, while its peers wait for it. So once this node's children train, the
supervisor keeps one standby (``standby``; ``Standbys.keep_ready``)
for the whole node, whatever ``--nproc-per-node``: the next child started on
this node, of whichever local rank (a per-rank restart, or the first rank of a
job-wide restart; the others start cold), becomes it, if it is warm. One still
importing stays for a later restart and the rank starts cold, so a standby is
never slower than a fresh interpreter (a script that imports nothing heavy
starts faster cold than a standby that imports torch first).

A standby imports torch, and on a node with few cores it would slow the ranks' own
start. So the first one is started once every child of the node told that it trains
(``Child.training``: its Wrapper monitor beat from a round, or its fault-tolerance
client connected). The node's children run one command: once one of them told anything
(a Wrapper monitor beats first, before its round), the node waits for all of them, then
and after any later restart, and says so in its log past ``--standby-wait``. A script
that uses neither tells nothing, and gets its standby ``--standby-wait`` after its last
child started; so does a first start whose imports take longer than that, since a Wrapper
rank tells only once it calls the Wrapper. The next one is started the same way after a
replacement, and never while the job stops, a store failover runs or a job-wide restart
waits for its children to end.
``standby_start`` tells its pid, ``standby_ready`` when it is warm (it and the Wrapper
monitor it started ahead are past their imports), once, where the supervisor first sees it:
its selector wakes on it, or a restart takes it before the selector told.
One that died before it was needed is replaced, with a warning (and what it printed on a
piped stream, on the console: ``RankOutput.show``); after
``standby.MAX_DEATHS`` such deaths restarts start cold. It is discarded at the
end, with the monitor process it started ahead.

Its imports run at the ranks' priority. Lower (a ``nice`` thread for the
imports, the script on the main thread at the process's priority), they made
no measurable difference to the training beside it, neither on this 2-core
machine nor pinned to 2 cores of a larger one (``bench/standby_cost.py``): each
process the supervisor starts has a session of its own, and with the kernel's
autogroups a session competes as a whole. And a lower priority would have made
it slower to get warm. ``--no-warm-standby`` turns it off.

A standby for restarts does not know its local rank: a stream that
``--redirects``/``--tee``/``--local-ranks-filter`` route differently for some
local rank is piped, and routed as the rank's when it becomes one (``rank_output``).
"""

from __future__ import annotations

import logging
import time

from .course import Course, CourseTracker
from .job_store import JobStore
from .local_ranks import LocalRanks
from .node_control import NodeControl
from .standby import Standbys

log = logging.getLogger(__name__)


class RestartStandby:
    """Keeps one standby ready for this node's next restart, while the node trains."""

    def __init__(
        self,
        store: JobStore,
        standbys: Standbys,
        course: CourseTracker,
        control: NodeControl,
        ranks: LocalRanks,
    ) -> None:
        self.store, self.standbys, self.course, self.control = store, standbys, course, control
        self.ranks = ranks
        self._tells = False  # a child of this node told of itself: the command tells
        self._said: tuple[int, ...] = ()  # the children a log line said the standby waits for
        standbys.on_warm = self._warm  # the selector's wake-up or a restart, whichever is first

    def keep_ready(self) -> None:
        """Start a standby for the next restart when none waits and this node trains."""
        cfg = self.store.config
        if self.course.state is not Course.TRAINING:
            return  # stopping, failing over, restarting the job, or a spare
        node_rank, ranks, control = self.control.node_rank, self.ranks, self.control
        if node_rank is None or len(ranks.children) < cfg.nproc_per_node or not ranks.running():
            return  # a spare waiting, children not all started yet, or all ended
        if self._waiting():
            return  # its children still start: it would compete with their imports
        local_ranks = range(cfg.nproc_per_node)
        pid = self.standbys.keep_ready(
            cfg.command, lambda: cfg.child_env(0, 1, node_rank=node_rank), local_ranks
        )
        if pid is not None:
            log.info("warm standby for restarts: pid %d", pid)
            control.emit("standby_start", standby_pid=pid, purpose="restart")

    def _waiting(self) -> bool:
        """Whether the standby waits for a child that did not tell it trains: until
        ``--standby-wait`` after the last child started, and on while its command tells."""
        running = self.ranks.running()
        self._tells = self._tells or any(child.tells for child in running)
        if all(child.training for child in running):
            return False
        if self.deadline() is not None:
            return True
        if not self._tells:
            return False  # a script that tells nothing
        late = tuple(child.pid for child in running if not child.training)
        if late != self._said:
            self._said = late
            log.info(
                "the standby for restarts waits for local ranks %s to train (their Wrapper "
                "in a round, or a fault-tolerance client connected); restarts start cold "
                "until then", sorted(c.local_rank for c in running if not c.training),
            )  # fmt: skip
        return True

    def deadline(self) -> float | None:
        """When the wait for children that do not tell they train reaches
        ``--standby-wait`` after the last one started (the loop wakes for it); None once
        it did, or when no child is waited for."""
        running = self.ranks.running()
        if not self.standbys.enabled or not running or all(c.training for c in running):
            return None
        end = max(child.started for child in running) + self.store.config.standby_wait
        return end if end > time.monotonic() else None

    def on_ready(self) -> None:
        """The standby for restarts said it is warm (or ended: replaced at the next turn)."""
        self.standbys.on_ready()

    def _warm(self, pid: int, warm_up_s: float) -> None:
        """``standby_ready``, once for each standby for restarts that became warm."""
        self.control.emit(
            "standby_ready", standby_pid=pid, purpose="restart", warm_up_s=round(warm_up_s, 3)
        )
