"""Key layout of the nvrx store.

Everything nvrx writes lives under ``nvrx/``. Keys that belong to one restart
round live under ``nvrx/r<round>/`` (the names below ``round_prefix`` are
relative to it), so a round never reads a key an earlier round (or an earlier
process generation) left behind. Inside a round a rank is named by its rank in
that round; the keys of the rejoin protocol (``join_request``, ``admission``)
name it by its *initial* rank, the one identity a process keeps for its whole
life.
"""

from __future__ import annotations

ROOT = "nvrx/"

#: Round the job is in now (int; written by the rank that completes a generation's
#: initial barrier or a round's iteration barrier).
CURRENT_ROUND = ROOT + "round"
#: Restarts of the job so far, in-process and process restarts together (counter).
JOB_RESTARTS = ROOT + "job_restarts"
#: Torch's own keys written through the env:// rendezvous (``init_process_group``).
TORCH_DEFAULT_PG_PREFIX = "default_pg/"


def round_prefix(round_: int) -> str:
    """Prefix of every key of restart round ``round_``."""
    if round_ < 0:
        raise ValueError(f"round must be >= 0, got {round_}")
    return f"{ROOT}r{round_}/"


def join_request(initial_rank: int) -> str:
    """Set by a replacement process that wants to rejoin the job (value: its pid)."""
    return f"{ROOT}join/{initial_rank}"


def admission(initial_rank: int, pid: int) -> str:
    """Set by the job for an admitted replacement process (value: JSON ``rejoin.Admission``)."""
    return f"{ROOT}admit/{initial_rank}/{pid}"


#: Everything about ranks that will not come back (``nvrx.store.gone_ranks``).
GONE_PREFIX = ROOT + "gone/"
#: Append-only ``"r,"`` list of the initial ranks marked gone.
GONE_LIST = GONE_PREFIX + "all"


def rank_gone(initial_rank: int) -> str:
    """Set when the process of ``initial_rank`` will not come back (its node was lost, no
    spare took it over): survivors do not wait for its replacement."""
    return f"{GONE_PREFIX}{initial_rank}"


#: Without a supervisor, one monitor per host beats for the host's ranks
#: (``nvrx.inprocess.host_beats``): a host's *slot* is its place in the ring of hosts.
HOSTS_PREFIX = ROOT + "host/"
#: Counter: host slots handed out (a slot taken twice by one host is ended at once).
HOST_COUNT = HOSTS_PREFIX + "count"


def host_slot(host: str) -> str:
    """The slot of ``host`` (compare-and-set once: the first leader of the host decides it)."""
    return f"{HOSTS_PREFIX}slot/{host}"


def host_alive(slot: int) -> str:
    """Counter the leader of host ``slot`` bumps every heartbeat interval."""
    return f"{HOSTS_PREFIX}alive/{slot}"


def host_claim(slot: int) -> str:
    """Counter whose first increment ends host ``slot``: its last monitor ended, or the host
    that watches it found it silent and took its ranks out."""
    return f"{HOSTS_PREFIX}claim/{slot}"


def host_ranks(slot: int) -> str:
    """Append-only ``"r,"`` list of the initial ranks on host ``slot``: each rank's monitor
    adds its own when it starts watching, before its rank goes on."""
    return f"{HOSTS_PREFIX}ranks/{slot}"


def host_ended(slot: int) -> str:
    """Append-only ``"r,"`` list of those whose monitor stopped beating on purpose."""
    return f"{HOSTS_PREFIX}ended/{slot}"


# Names inside one round's prefix --------------------------------------------
INTERRUPTED = "interrupted"  # "fault" when any rank faults, "done" when the round completed
FAULT_LIST = "faults"  # append-only JSON fault records, one per line (``nvrx.store.faults``)
TERMINATED = "terminated"  # append-only "r," list of the round's ranks that left the job
DECISION = "decision"  # JSON written by the last arrival at the iteration barrier
REJOIN = "rejoin"  # JSON: ranks whose replacement process rejoined (written by the round's leader)
COMPLETED = (
    "completed"  # set by an active rank that returned (or by a monitor thread, to wake spares)
)
STARTED = (
    "started"  # counter: ranks that started the round (the first one commits the restart count)
)
LATE_DEATHS = "late_deaths"  # counter: ranks counted in the round that died before starting it


def heartbeat(rank: int) -> str:
    """Heartbeat counter of the monitor process of ``rank`` in the round: no monitor beats
    per rank any more (``host_beats``); ``bench/store_load.py`` sends the old pattern."""
    return f"hb/{rank}"


def rank_state(rank: int) -> str:
    """JSON state of ``rank`` at the start of the round (read for a replacement of it)."""
    return f"state/{rank}"


def late_death_claim(rank: int) -> str:
    """Counter by which the monitor of one rank that died before starting the round takes
    ``rank``, a number of the round that no rank published its state under."""
    return f"late_death_claim/{rank}"


def terminated_flag(rank: int) -> str:
    """Counter that makes registering ``rank`` as terminated in the round idempotent."""
    return f"terminated_flag/{rank}"
