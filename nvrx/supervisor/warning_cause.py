"""What SLURM's warning signal means: preemption or time limit, and how long is left.

The signal alone does not say which of the two happened, so ``classify`` asks
slurmctld's view of the job (``scontrol show job``): a set ``PreemptTime``
means preemption; otherwise the time left against the warning delay tells a
time limit from a preemption (submitit's elapsed-versus-limit rule when the
delay is unknown). slurmctld checks time limits periodically and sends the
warning up to 60 s before the delay asks (``man sbatch``, ``--signal``), so a
time-limit warning may come with that much more time left.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from nvrx.slurm import commands

log = logging.getLogger(__name__)

#: Seconds of lag allowed between SLURM's warning and our look at the job's clock.
TIME_LIMIT_SLACK_S = 5.0
#: How much earlier than ``--signal=SIG@delay`` asks SLURM may send the warning.
SLURM_SIGNAL_EARLY_S = 60.0
#: Seconds a preempted job may use to checkpoint when the partition's GraceTime is unknown.
DEFAULT_PREEMPT_WINDOW_S = 30.0
CAUSES = ("preemption", "time_limit", "unknown")
_NO_TIME = ("", "None", "N/A", "Unknown", "(null)")
#: sbatch's ``--time`` formats: ``M``, ``M:S``, ``H:M:S``; ``D-H``, ``D-H:M``, ``D-H:M:S``.
_DURATION = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$")
_DAYS_DURATION = re.compile(r"^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_duration(text: str | None) -> float | None:
    """Seconds in a SLURM duration, in any of sbatch's ``--time`` formats (``scontrol`` writes
    ``[D-]HH:MM:SS`` or ``MM:SS``): ``minutes``, ``minutes:seconds``,
    ``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes`` or
    ``days-hours:minutes:seconds``. None for UNLIMITED or junk."""
    if not text:
        return None
    text = text.strip()
    days = _DAYS_DURATION.match(text)
    if days:
        d, h, m, s = (int(g) if g else 0 for g in days.groups())
        return float(((d * 24 + h) * 60 + m) * 60 + s)
    match = _DURATION.match(text)
    if not match:
        return None
    parts = [int(g) for g in match.groups() if g is not None]
    if len(parts) == 1:  # minutes alone
        return float(parts[0] * 60)
    hours, minutes, seconds = [0] * (3 - len(parts)) + parts
    return float((hours * 60 + minutes) * 60 + seconds)


def _run_time_at_warning(info: Mapping[str, str], late_s: float) -> float | None:
    """The job's ``RunTime`` when the warning came, ``late_s`` seconds before ``info`` was read."""
    run = parse_duration(info.get("RunTime"))
    return None if run is None else max(0.0, run - max(0.0, late_s))


def classify(info: Mapping[str, str] | None, signal_delay_s: float | None, late_s: float = 0.0) -> str:
    """``preemption``, ``time_limit`` or ``unknown`` from ``scontrol show job`` fields, read
    ``late_s`` seconds after the warning came (one noted before srun ran is acted on later).

    A time-limit warning comes when at most ``signal_delay_s`` seconds (plus
    SLURM's up to 60 s of earliness) are left; a warning with clearly more
    time left is a preemption.
    """
    if not info:
        return "unknown"
    if info.get("PreemptTime", "None") not in _NO_TIME:
        return "preemption"
    limit = parse_duration(info.get("TimeLimit"))
    run = _run_time_at_warning(info, late_s)
    if limit is None or run is None:
        return "unknown" if limit is not None else "preemption"
    if signal_delay_s is not None:
        latest = signal_delay_s + SLURM_SIGNAL_EARLY_S + TIME_LIMIT_SLACK_S
        return "time_limit" if limit - run <= latest else "preemption"
    return "time_limit" if run >= min(0.8 * limit, limit - 600.0) else "preemption"


def window_s(
    info: Mapping[str, str] | None,
    cause: str,
    signal_delay_s: float | None,
    preempt_window_s: float | None,
    late_s: float = 0.0,
) -> float:
    """Seconds from the warning until the job must have stopped, minus a margin.

    A time limit leaves what ``scontrol`` says is left, ``info`` read ``late_s`` seconds
    after the warning came: that much more; without it, the signal's delay (never the
    preemption window); a preemption leaves
    ``preempt_window_s`` when given, else the partition's GraceTime, else
    ``DEFAULT_PREEMPT_WINDOW_S``.
    """
    if cause == "time_limit":  # what is left: scontrol's, else the signal's own delay
        limit, run = parse_duration((info or {}).get("TimeLimit")), _run_time_at_warning(info or {}, late_s)
        window = (limit - run) if limit is not None and run is not None else signal_delay_s
    elif preempt_window_s is not None:
        window = preempt_window_s
    else:
        window = partition_grace_time(info) if cause == "preemption" else None
        if window is None:
            window = DEFAULT_PREEMPT_WINDOW_S
    window = float(window if window is not None else DEFAULT_PREEMPT_WINDOW_S)
    return max(1.0, window - min(10.0, 0.25 * window))


def partition_grace_time(info: Mapping[str, str] | None) -> float | None:
    """GraceTime of the job's partition in seconds (what preemption leaves), None if unknown."""
    partition = (info or {}).get("Partition", "").split(",")[0]
    if not partition:
        return None
    try:
        done = commands.run_command(["scontrol", "show", "partition", "-o", partition])
    except commands.SlurmCommandError as exc:
        log.warning("cannot read GraceTime of partition %s: %s", partition, exc)
        return None
    grace = commands.parse_key_values(done.stdout).get("GraceTime", "")
    return float(grace) if grace.isdigit() and int(grace) > 0 else None
