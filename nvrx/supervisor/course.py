"""The course of one supervisor's run: one state at a time, and the moves allowed between them.

A supervisor's run goes through the states of ``Course``; every move is
checked against ``TRANSITIONS``, so a move the design does not allow raises
at once instead of leaving the supervisor in a state nobody planned for.
Counters, timestamps and reasons (the stop reason, the kill deadline, the
restart epoch) stay data of their owners.
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger(__name__)


class Course(enum.Enum):
    """Where a supervisor's run stands; the moves ``TRANSITIONS`` allows::

        STARTING ──> TRAINING | SPARE          (children start, or the slot waits as a spare)
        SPARE ──> TRAINING                      (it takes over a lost node's rank)
        TRAINING | SPARE ──> RESTARTING ──> TRAINING | SPARE   (a job-wide restart, then its go)
        TRAINING | SPARE | RESTARTING | FINISHING ──> FAILING_OVER ──> back to where it was
        TRAINING | SPARE ──> FINISHING          (all children ended; every training node finished)
        TRAINING | SPARE | RESTARTING | FINISHING ──> STOPPING
        any state ──> ENDED                     (the run is over, an error included)

    * ``STARTING``: the store and the rank watch come up; no child runs yet.
    * ``TRAINING``: this node holds a node rank; its children run, and each exit
      is decided on (restart, or stop the job).
    * ``SPARE``: a spare slot waits to take over a lost node's rank (``TRAINING``),
      or for every training node to finish (``FINISHING``).
    * ``RESTARTING``: a job-wide restart: the children stop, the node waits for
      every other one to be ready, then starts them again (``TRAINING``; a spare
      that took no rank goes back to ``SPARE``).
    * ``FAILING_OVER``: the store was lost with its host: the children end (no
      restart decision), the survivors elect the next store; then the course
      goes back to the state the loss interrupted.
    * ``STOPPING``: the job stops: children are asked to end and killed after
      the grace period; nothing is restarted any more.
    * ``FINISHING``: every child ended without a stop: the node reports itself
      done, and the store host waits for the others (a stop may still come).
    * ``ENDED``: the run is over.
    """

    STARTING = "starting"
    TRAINING = "training"
    SPARE = "spare"
    RESTARTING = "restarting"
    FAILING_OVER = "failing_over"
    STOPPING = "stopping"
    FINISHING = "finishing"
    ENDED = "ended"


#: The states each state may move to.
TRANSITIONS: dict[Course, frozenset[Course]] = {
    Course.STARTING: frozenset({Course.TRAINING, Course.SPARE, Course.ENDED}),
    Course.TRAINING: frozenset(
        {Course.RESTARTING, Course.FAILING_OVER, Course.STOPPING, Course.FINISHING, Course.ENDED}
    ),
    Course.SPARE: frozenset(
        {
            Course.TRAINING,
            Course.RESTARTING,
            Course.FAILING_OVER,
            Course.STOPPING,
            Course.FINISHING,
            Course.ENDED,
        }
    ),
    Course.RESTARTING: frozenset(
        {Course.TRAINING, Course.SPARE, Course.FAILING_OVER, Course.STOPPING, Course.ENDED}
    ),
    Course.FAILING_OVER: frozenset(
        {Course.TRAINING, Course.SPARE, Course.RESTARTING, Course.FINISHING, Course.ENDED}
    ),
    Course.STOPPING: frozenset({Course.ENDED}),
    Course.FINISHING: frozenset({Course.FAILING_OVER, Course.STOPPING, Course.ENDED}),
    Course.ENDED: frozenset(),
}


class IllegalMove(RuntimeError):
    """A move the course does not allow: a bug in the supervisor, never the user's doing."""


class CourseTracker:
    """The current state of a supervisor's run; ``to`` makes the only moves allowed."""

    def __init__(self) -> None:
        self.state = Course.STARTING

    def to(self, new: Course) -> None:
        """Move to ``new``; raises ``IllegalMove`` when ``TRANSITIONS`` does not allow it."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalMove(f"the supervisor cannot go from {self.state.name} to {new.name}")
        log.debug("course: %s -> %s", self.state.name, new.name)
        self.state = new

    @property
    def stopping(self) -> bool:
        """The job stops here: no child is started or restarted any more."""
        return self.state is Course.STOPPING

    def one_of(self, *states: Course) -> bool:
        """Whether the run stands in one of ``states``."""
        return self.state in states
