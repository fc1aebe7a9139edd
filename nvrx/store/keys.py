"""Key layout of the nvrx store.

Everything nvrx writes lives under ``nvrx/``. Keys that belong to one restart
round live under ``nvrx/r<round>/``, so a round never reads a key an earlier
round (or an earlier process generation) left behind. Per-rank keys use the
rank's *initial* rank, the one identity a process keeps for its whole life.
"""

from __future__ import annotations

ROOT = "nvrx/"

#: Round the job is in now (int, set by the leader when a round starts).
CURRENT_ROUND = ROOT + "round"
#: Process generations seen by the store (counter; a restarted process bumps it).
GENERATION = ROOT + "generation"
#: Restarts of the job so far, in-process and process restarts together (counter).
JOB_RESTARTS = ROOT + "job_restarts"
#: Counter every monitor process bumps at each heartbeat: the job is alive while it moves.
ALIVE = ROOT + "alive"
#: Torch's own keys written through the env:// rendezvous (``init_process_group``).
TORCH_DEFAULT_PG_PREFIX = "default_pg/"


def round_prefix(round_: int) -> str:
    """Prefix of every key of restart round ``round_``."""
    if round_ < 0:
        raise ValueError(f"round must be >= 0, got {round_}")
    return f"{ROOT}r{round_}/"


def heartbeat(initial_rank: int) -> str:
    """Heartbeat counter of one rank's monitor process (global, not per round)."""
    return f"{ROOT}hb/{initial_rank}"


def join_request(initial_rank: int) -> str:
    """Set by a replacement process that wants to rejoin the job (value: its pid)."""
    return f"{ROOT}join/{initial_rank}"


def admission(initial_rank: int, pid: int) -> str:
    """Set by the job for an admitted replacement process (value: the round it joins)."""
    return f"{ROOT}admit/{initial_rank}/{pid}"


# Names inside one round's prefix --------------------------------------------
INTERRUPTED = "interrupted"  # set when any rank faults (or when the round completed)
FAULT_LIST = "faults"  # append-only list of initial ranks that recorded a fault
TERMINATED = "terminated"  # append-only list of initial ranks that left the job
DECISION = "decision"  # JSON written by the last arrival at the iteration barrier
REJOIN = "rejoin"  # JSON: ranks whose replacement process rejoined (written by the round's leader)
COMPLETED = "completed"  # set by an active rank that returned from the function
PARTICIPANTS = "participants"  # JSON list of initial ranks taking part in the round


def fault_record(initial_rank: int) -> str:
    """JSON fault record of one rank in a round."""
    return f"fault/{initial_rank}"


def rank_state(initial_rank: int) -> str:
    """JSON state of one rank at the start of a round (used by a rejoining replacement)."""
    return f"state/{initial_rank}"


def terminated_flag(initial_rank: int) -> str:
    """Counter that makes registering a rank as terminated idempotent."""
    return f"terminated_flag/{initial_rank}"
