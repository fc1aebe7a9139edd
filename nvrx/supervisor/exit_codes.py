"""Exit codes of ``nvrx-supervise`` and ``fork_and_monitor``: each one says why the job ended.

Every supervisor of a job that stops for a job-wide reason (budget exhausted,
loop breaker, a rank's RestartAbort) returns the same code, because the reason travels
through the store with the stop request.
"""

from __future__ import annotations

import enum
import signal

#: A child exiting with this code stops the whole job without a restart (``RestartAbort``).
CLEAN_STOP_EXIT = 130


class ExitCode(enum.IntEnum):
    """Exit codes of a supervisor; 128+N (N a signal number) means "stopped by signal N"."""

    OK = 0  # every child completed (or a rank asked to shut the workload down)
    INTERNAL = 1  # a bug or an unexpected error in the supervisor itself
    USAGE = 2  # bad command line or configuration (the message names the fix)
    STORE_UNAVAILABLE = 3  # the job's store could not be reached or was lost
    BUDGET_EXHAUSTED = 4  # the job-wide restart budget (--max-restarts) is used up
    LOOP_BREAKER = 5  # the same failure signature K times in a row (--loop-breaker)
    PEER_LOST = 6  # other nodes did not finish, or one never became ready for a job-wide restart
    SPAWN_FAILED = 7  # the training command could not be started (not found, not executable)
    NODE_LOST = 8  # a node was lost, no spare was left and the job fell below --min-nodes
    FENCED = 9  # this node was declared lost while it stalled; the job went on without it
    EXCLUDED = 10  # excluded (ExcludeThisNode, or a straggler under --straggler-action exclude)
    NON_RETRYABLE = 11  # a rank failed with a non-retryable exception (--ft-non-retryable-exception-file)
    RANK_STOPPED = 12  # a child exited 130 (RestartAbort: its Wrapper gave up): stopped, no restart
    AFTER_COMPLETION = 13  # a failure after another node's ranks completed: no job-wide restart
    REQUEUED = 75  # SLURM warned; children checkpointed, the store's host requeued the job


#: One line per code, for docs/supervisor.md and for log messages.
DESCRIPTIONS: dict[int, str] = {
    ExitCode.OK: "all children completed, or a rank asked to shut the workload down",
    ExitCode.INTERNAL: "unexpected error inside the supervisor (see its log)",
    ExitCode.USAGE: "bad command line or configuration",
    ExitCode.STORE_UNAVAILABLE: "the job's store could not be reached, or was lost",
    ExitCode.BUDGET_EXHAUSTED: "job-wide restart budget (--max-restarts) used up",
    ExitCode.LOOP_BREAKER: "same failure signature --loop-breaker times in a row",
    ExitCode.PEER_LOST: "other nodes did not finish within --finish-timeout (fork_and_monitor's "
    "finish_timeout); or a job-wide restart waited in vain for a slot to be ready: without node "
    "liveness (fork_and_monitor) a monitor, for grace_period + store_timeout; with it the store "
    "host's supervisor, for --grace-period + --store-timeout + --node-timeout",
    ExitCode.SPAWN_FAILED: "the training command could not be started",
    ExitCode.NODE_LOST: "node lost, no spare: a node was lost, no spare node was left and "
    "fewer than --min-nodes nodes remained",
    ExitCode.FENCED: "this node was declared lost by the others while it stalled (frozen, "
    "overloaded); its children were ended and the job went on without it",
    ExitCode.EXCLUDED: "a rank asked to exclude this node (ExcludeThisNode), or it was named a "
    "straggler under --straggler-action exclude: its children were stopped and it left the job "
    "as a lost node (a spare takes over, or the job stops)",
    ExitCode.NON_RETRYABLE: "a rank failed with an exception of --ft-non-retryable-exception-file: "
    "the job stopped without a restart",
    ExitCode.RANK_STOPPED: "a child exited with 130 (RestartAbort: its in-process Wrapper gave "
    "up, or the code asked to stop): every child was stopped, none restarted; training did not "
    "complete",
    ExitCode.AFTER_COMPLETION: "a rank failed after every rank of another node had completed: "
    "a job-wide restart starts every rank of every node again, and those had ended, so the job "
    "stopped without one",
    ExitCode.REQUEUED: "preemption or time-limit warning: checkpointed, job requeued (docs/submit.md)",
}


def for_signal(signum: int) -> int:
    """Exit code of a supervisor that stopped because it received ``signum`` (shell convention)."""
    return 128 + int(signum)


def describe(code: int) -> str:
    """Human description of a supervisor exit code."""
    if code in DESCRIPTIONS:
        return DESCRIPTIONS[code]
    if code > 128:
        try:
            return f"stopped by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"unknown exit code {code}"


def exit_code_help() -> str:
    """The exit codes, as ``--help`` lists them."""
    return (
        "exit codes:\n"
        + "\n".join(f"  {int(code):3d}  {text}" for code, text in DESCRIPTIONS.items())
        + ("\n  128+N  stopped by signal N (143 = SIGTERM, 130 = SIGINT)")
    )


class SupervisorError(RuntimeError):
    """A failure that ends the supervisor with ``code``; the message names the fix."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = int(code)
