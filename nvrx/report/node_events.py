"""Per-node events (supervisor, store, launcher) as the report keeps them: whole, as they are few.

Their common fields are kept as read (the reader checked them), their own fields
made the type the report expects (None when unusable). Whether a child's exit
was a failure or part of a stop is decided once all of them are known
(``build.aggregate_files``, ``process_rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .values import as_str, count, flag, int_list, num, seconds, str_dict, str_list


def restart_cause(value: Any) -> dict[str, Any] | None:
    """A ``job_restart`` event's cause as the report keeps it: rank, node and signature."""
    if not isinstance(value, dict):
        return None
    return {
        "rank": count(value.get("rank")),
        "node": count(value.get("node")),
        "signature": as_str(value.get("signature")),
    }


#: Kinds of per-node events that mean "the job is being stopped on this host".
STOP_KINDS = ("job_stop", "supervisor_end")
#: Kinds of per-node (supervisor, store, launcher) events kept whole: they are few.
NODE_EVENT_KINDS = frozenset(
    {
        "supervisor_start",
        "supervisor_end",
        "child_start",
        "child_exit",
        "restart_decision",
        "rejoin",
        "job_stop",
        "signal_received",
        "requeue",
        "preempt_signal",
        "store_start",
        "store_end",
        "node_lost",
        "node_takeover",
        "node_probe",
        "job_restart",
        "store_failover",
        "straggler",
        "rejected_write",
    }
)
#: Common fields of per-node events kept as read (the reader checked them).
NODE_COMMON_FIELDS = ("kind", "wall", "mono", "boot", "host", "node", "rank", "round", "component")
#: Their own fields kept, each made the type the report expects (None when unusable).
NODE_OWN_FIELDS: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(("local_rank", "child_pid", "attempt", "exit_code", "budget_left"), count),
    **dict.fromkeys(("count", "nnodes", "nproc_per_node", "global_rank", "spare_nodes"), count),
    **dict.fromkeys(("lost_node", "lost_slot", "seen_by", "replaced_by", "node_rank"), count),
    **dict.fromkeys(("runtime_s", "wait_s", "silent_s", "duration_s", "probe_s"), seconds),
    **dict.fromkeys(("signal", "decision", "reason", "signature", "action", "cause"), as_str),
    **dict.fromkeys(("lost_host", "files", "error_file", "phase", "scope"), as_str),
    **dict.fromkeys(("old_store", "new_store"), as_str),
    "epoch": count,
    # The SLURM run its writer ran in (a common field, read as any own one): ``JobSummary.part_of``
    # files the event under the job run it is, then drops it.
    "slurm_run": count,
    "successor": count,
    "last_seen_wall": num,
    "slurm_state": str_dict,
    "ranks": int_list,
    # A requeue's for lost nodes: who it excluded and who not, and what SLURM refused.
    **dict.fromkeys(("excluded", "answered", "required", "exclude_refused"), str_list),
    **dict.fromkeys(("exclude_error", "issued_by", "slurm_job_id"), as_str),
    **dict.fromkeys(("responding", "held"), flag),
    # A straggler's: what was named, where, and the step times that named it.
    **dict.fromkeys(("of", "state", "straggler_host", "source"), as_str),
    **dict.fromkeys(("who", "slot", "step", "window"), count),
    **dict.fromkeys(("score", "median_s", "reference_s", "slower_pct", "threshold"), num),
    # A rejected write's: the key and the size of the value refused.
    "key": as_str,
    "value_bytes": count,
}



def kept_node_event(e: dict[str, Any], host: str | None, file_host: str | None) -> dict[str, Any]:
    """What the report keeps of per-node event ``e`` whose writer's host is ``host`` (None: it
    names none, and the file's ``file_host`` stands in)."""
    kept = {k: e[k] for k in NODE_COMMON_FIELDS if k in e}
    for k, value in e.items():  # an event holds a few of the own fields
        make = NODE_OWN_FIELDS.get(k)
        if make is not None:
            kept[k] = make(value)
    if host is None:
        kept.pop("host", None)
        if file_host is not None:
            kept["host"] = file_host
    if e.get("kind") == "job_restart":  # its cause is the announced failure, not a word
        kept["cause"] = restart_cause(e.get("cause"))
    return kept
