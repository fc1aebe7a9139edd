"""srun's ``--export``, as ``nvrx-srun`` finds it, widened to let nvrx's variables through.

``nvrx-srun`` gives the supervisors variables of its own through srun's environment: the job's
secret (``NVRX_JOB_SECRET``) and the warning that came before srun ran (``NVRX_WARNED_AT``);
and the settings the supervisors read (the warning signal's name ``NVRX_PREEMPT_SIGNAL``, the
log directory, the warning's delay...) come the same way. With srun's default (``--export=ALL``) all of
them reach every task; a restrictive ``--export`` drops them, whether it is in
``NVRX_SRUN_ARGS`` or in ``SLURM_EXPORT_ENV`` (which ``sbatch --export=NONE`` sets for the
batch script, and srun reads as its ``--export``). So ``nvrx-srun`` names every ``NVRX_*``
variable of its environment, and the two it sets itself, in that ``--export``.

What srun does with a value (SLURM 22.05.8, seen on a real cluster): the last ``--export`` of
its command line wins over earlier ones and over ``SLURM_EXPORT_ENV``; a value is a
comma-separated list, split at every comma, empty items skipped; srun reads no item past a
``NONE`` (any case), so ``NONE`` first passes SLURM's variables alone and ``PATH,NONE,HOME``
passes ``PATH``; ``ALL`` among the items before it passes the whole environment (``NONE,ALL``
does not); otherwise the list passes SLURM's variables and the ones it names (``NAME`` with
its value here, skipped where unset; ``NAME=VALUE`` as given; a later
item wins over an earlier one of its name). srun takes an unambiguous beginning of a long
option for the option (``--exp=NONE``).

Names only, never values: a value on srun's command line is there for anyone who lists the
machine's processes, and the secret must not be; srun reads each named value from its own
environment as it starts, so ``NVRX_WARNED_AT`` and the secret, set just before the exec, go
with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nvrx import jobenv

#: srun's own variable for its ``--export``, read where its command line has none.
EXPORT_ENV = "SLURM_EXPORT_ENV"
#: The spellings srun takes for ``--export``: ``--ex`` also begins --exact, --exclude,
#: --exclusive and --extra-node-info.
EXPORT_SPELLINGS = ("--exp", "--expo", "--expor", "--export")
#: What ``nvrx-srun`` sets itself for the supervisors, set or not when the command is built.
OWN_VARIABLES = (jobenv.JOB_SECRET, jobenv.WARNED_AT)


class ExportError(ValueError):
    """An ``--export`` that ``nvrx-srun`` cannot widen; the message says what to fix."""


def passed_names(env: Mapping[str, str]) -> list[str]:
    """The variables the supervisors need from ``nvrx-srun``'s environment ``env``: the ones it
    sets itself and every ``NVRX_*`` one there, sorted."""
    return sorted({*OWN_VARIABLES, *(name for name in env if name.startswith("NVRX_"))})


def widened(value: str, names: Sequence[str]) -> str | None:
    """The ``--export`` value that passes what ``value`` passes and ``names`` too; None where
    ``value`` passes the whole environment already (``ALL``). Items from a ``NONE`` on, which
    srun does not read, give way to ``names``."""
    items = [item for item in value.split(",") if item]
    upper = [item.upper() for item in items]
    kept = items[: upper.index("NONE")] if "NONE" in upper else items
    if any(item.upper() == "ALL" for item in kept):
        return None
    named = {item.split("=", 1)[0] for item in kept}
    return ",".join([*kept, *(name for name in names if name not in named)])


def _export_at(args: Sequence[str], i: int) -> tuple[int, str] | None:
    """(how many arguments, the value) of an ``--export`` at ``args[i]``; None for another."""
    option, equals, value = args[i].partition("=")
    if option not in EXPORT_SPELLINGS:
        return None
    if equals:
        return 1, value
    if i + 1 == len(args):
        raise ExportError(
            f"{args[i]} ends {jobenv.SRUN_ARGS} without its value: give --export=NAME,... (or ALL)"
        )
    return 2, args[i + 1]


def with_names_exported(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """srun options ``args`` (``NVRX_SRUN_ARGS``, split) with the ``--export`` that srun will
    follow, the last one there or else ``$SLURM_EXPORT_ENV`` of ``env``, widened to pass
    ``passed_names(env)``: the last one rewritten in place, or one added at the end. Unchanged
    where srun passes the whole environment."""
    out = list(args)
    last: tuple[int, int, str] | None = None
    i = 0
    while i < len(args):
        found = _export_at(args, i)
        if found is not None:
            last = (i, found[0], found[1])
        i += found[0] if found is not None else 1
    value = env.get(EXPORT_ENV) if last is None else last[2]
    wide = None if value is None else widened(value, passed_names(env))
    if wide is None:
        return out
    if last is None:
        return [*out, f"--export={wide}"]
    start, count, _ = last
    out[start : start + count] = [f"--export={wide}"]
    return out
