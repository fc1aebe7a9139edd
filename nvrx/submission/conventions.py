"""submitit's names for nvrx's settings: parameter aliases and the warning signal.

A submitit user's parameters and environment keep working under ``nvrx.submit``:

- ``slurm_signal_delay_s`` is ``signal_delay_s``; ``max_num_timeout`` and
  ``slurm_max_num_timeout`` are ``max_time_limit_requeues``. Each pair is one
  setting: either name sets it, two names with different values is an error.
- submitit's cluster-specific names of the parameters nvrx checks are those parameters:
  on SLURM ``slurm_nodes`` is ``nodes``, ``slurm_tasks_per_node`` and ``slurm_ntasks_per_node``
  are ``tasks_per_node``, ``slurm_timeout_min`` and ``slurm_time`` are ``timeout_min``
  (``local_nodes``... on the local executor); submitit's prefix-less spellings of SLURM's
  names (``time``, ``use_srun``, ...) are its ``slurm_`` ones (``cluster_names``). On SLURM,
  ``slurm_additional_parameters``' ``time`` is ``timeout_min`` too, and a time limit there or
  in ``slurm_time`` may be one of sbatch's (``"2:00:00"``, ``"1-00:00:00"``): nvrx gives it
  to submitit in whole minutes.
- ``SUBMITIT_PREEMPT_SIGNAL`` (submitit's choice of warning signal) and
  ``NVRX_PREEMPT_SIGNAL`` (the signal nvrx's supervisors take as the warning)
  are one setting too. The signal SLURM is asked for (``--signal=<SIG>@<delay>``)
  and the one the supervisors wait for must be the same, or the warning is lost.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping
from typing import Any

from nvrx import jobenv, processes
from nvrx.processes import DEFAULT_WARNING_SIGNAL, signal_from_name
from nvrx.supervisor.warning_cause import parse_duration

#: submitit's variable naming the warning signal (read by submitit as ``SIG<name>``).
SUBMITIT_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"
NVRX_SIGNAL_ENV = jobenv.PREEMPT_SIGNAL
#: Signals nvrx's supervisors can take as the warning, as SLURM names them (``processes``).
WARNING_SIGNALS = tuple(s.name.removeprefix("SIG") for s in processes.WARNING_SIGNALS)
#: nvrx's setting -> submitit's names of the same setting, and what the setting is.
ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    "signal_delay_s": (("slurm_signal_delay_s",), "seconds of warning before the time limit"),
    "max_time_limit_requeues": (
        ("max_num_timeout", "slurm_max_num_timeout"),
        "how many times a job is requeued after its time limit",
    ),
}


class SubmitError(ValueError):
    """Bad submission parameters; raised before anything is submitted. The message names the fix."""


#: The generic parameters nvrx checks, and what each is.
CHECKED_GENERICS: dict[str, str] = {
    "nodes": "nodes of the job",
    "tasks_per_node": "tasks per node",
    "timeout_min": "the time limit in minutes",
}
#: ``slurm_additional_parameters``' ``time`` (sbatch's ``--time``), another name of
#: ``timeout_min`` on SLURM: submitit writes it over ``slurm_time``.
ADDITIONAL_TIME = "slurm_additional_parameters['time']"
#: submitit's SLURM names, beyond ``slurm_<generic>``, of the generic parameters nvrx checks.
SLURM_NAMES: dict[str, tuple[str, ...]] = {
    "tasks_per_node": ("slurm_ntasks_per_node",),
    "timeout_min": ("slurm_time", ADDITIONAL_TIME),
}
#: sbatch's formats of a time limit, for messages.
TIME_FORMATS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
#: Parameters submitit takes without their executor's prefix (it warns and adds ``slurm_``).
SLURM_UNPREFIXED = ("time", "ntasks_per_node", "use_srun", "additional_parameters", "srun_args")


def _merge(merged: dict[str, Any], name: str, aliases: tuple[str, ...], meaning: str) -> str | None:
    """Replace the names of one setting in ``merged`` by ``name``; the name given (the first
    of them), None when none was. SubmitError naming every name given when values differ."""
    given = [(n, merged.pop(n)) for n in (name, *aliases) if n in merged]
    if not given:
        return None
    if any(value != given[0][1] for _, value in given[1:]):
        names = [f"{n}={v!r}" for n, v in given]
        listed = ", ".join(names[:-1]) + " and " + names[-1]
        raise SubmitError(f"{listed} are one setting ({meaning}): give one of them")
    merged[name] = given[0][1]
    return given[0][0]


def merge_aliases(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with submitit's names replaced by nvrx's; SubmitError naming every name given
    for one setting when their values differ."""
    merged = dict(params)
    for name, (aliases, meaning) in ALIASES.items():
        _merge(merged, name, aliases, meaning)
    return merged


def cluster_names(params: Mapping[str, Any], cluster: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``params`` with submitit's names of ``nodes``, ``tasks_per_node`` and ``timeout_min``
    on ``cluster`` replaced by these (submitit gives them the cluster's value, so nvrx checks
    that value), and the name each was given under; prefix-less SLURM names get ``slurm_``,
    as submitit gives them. Two names of one setting with different values: SubmitError."""
    spelled = {f"slurm_{n}": n for n in params if n in SLURM_UNPREFIXED}
    for name in spelled:
        if name in params:
            raise SubmitError(f"{spelled[name]} and {name} are one setting: give one of them")
    merged = {(f"slurm_{n}" if n in SLURM_UNPREFIXED else n): v for n, v in params.items()}
    if cluster == "slurm":
        merged = _limits_in_minutes(merged)
    given_as: dict[str, str] = {}
    for name, meaning in CHECKED_GENERICS.items():
        aliases = (f"{cluster}_{name}", *(SLURM_NAMES.get(name, ()) if cluster == "slurm" else ()))
        given = _merge(merged, name, aliases, meaning)
        if given is not None:
            given_as[name] = spelled.get(given, given)
    return merged, given_as


def _limits_in_minutes(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with ``slurm_additional_parameters``' ``time`` taken out as its own name
    (``ADDITIONAL_TIME``), and SLURM's time limits given as text (``"2:00:00"``) in whole
    minutes (seconds rounded up), as submitit's ``timeout_min``; SubmitError for text that is
    no time limit."""
    merged = dict(params)
    extra = merged.get("slurm_additional_parameters")
    if isinstance(extra, Mapping) and "time" in extra:
        merged["slurm_additional_parameters"] = {k: v for k, v in extra.items() if k != "time"}
        if extra["time"] is not None:
            merged[ADDITIONAL_TIME] = extra["time"]
    for name in SLURM_NAMES["timeout_min"]:
        value = merged.get(name)
        if isinstance(value, str):
            seconds = parse_duration(value)
            if seconds is None:
                raise SubmitError(
                    f"{name}={value!r} is not a SLURM time limit ({TIME_FORMATS}); nvrx needs "
                    "a limit to warn the job before it"
                )
            merged[name] = math.ceil(seconds / 60)
    return merged


def _submitit_signal(name: str) -> signal.Signals:
    """The signal submitit makes of ``SUBMITIT_PREEMPT_SIGNAL`` (``SIG`` + the value, as is)."""
    found = getattr(signal, "SIG" + name, None)
    if not isinstance(found, signal.Signals):
        raise SubmitError(
            f"{SUBMITIT_SIGNAL_ENV}={name!r} is not a signal name submitit understands: "
            "write it without SIG, in capitals (e.g. USR2)"
        )
    return found


def warning_signal_name(env: Mapping[str, str]) -> str:
    """The warning signal of a job submitted from ``env``, as SLURM writes it (``USR2``).

    ``SUBMITIT_PREEMPT_SIGNAL`` and ``NVRX_PREEMPT_SIGNAL`` name the same
    setting: whichever is set, the same value when both are, default USR2.
    """
    submitit_name = env.get(SUBMITIT_SIGNAL_ENV) or None
    nvrx_name = env.get(NVRX_SIGNAL_ENV) or None
    chosen: dict[str, signal.Signals] = {}
    if submitit_name is not None:
        chosen[SUBMITIT_SIGNAL_ENV] = _submitit_signal(submitit_name)
    if nvrx_name is not None:
        try:
            chosen[NVRX_SIGNAL_ENV] = signal.Signals(signal_from_name(nvrx_name, NVRX_SIGNAL_ENV))
        except ValueError as exc:
            raise SubmitError(str(exc)) from None
    if len(set(chosen.values())) > 1:
        raise SubmitError(
            f"{NVRX_SIGNAL_ENV}={nvrx_name!r} and {SUBMITIT_SIGNAL_ENV}={submitit_name!r} are one "
            "setting (the signal SLURM warns the job with): set one of them, or both the same"
        )
    signum = next(iter(chosen.values()), signal.Signals["SIG" + DEFAULT_WARNING_SIGNAL])
    name = signum.name.removeprefix("SIG")
    if name not in WARNING_SIGNALS:
        where = " and ".join(f"{k}={env[k]!r}" for k in chosen)
        raise SubmitError(
            f"{where}: nvrx's supervisors take {' or '.join(WARNING_SIGNALS)} as the warning signal"
        )
    return name


def sbatch_signal(extra: Mapping[str, Any], signal_name: str, delay_s: int) -> dict[str, Any]:
    """``slurm_additional_parameters`` with ``signal`` set to ``<signal_name>@<delay_s>``: it
    overrides the ``--signal`` submitit writes from its own, possibly stale, choice. A different
    ``signal`` given there is an error: the supervisors would wait for another warning."""
    wanted = f"{signal_name}@{delay_s}"
    given = extra.get("signal")
    if given is not None and str(given) != wanted:
        raise SubmitError(
            f"slurm_additional_parameters['signal']={given!r} differs from the warning nvrx's "
            f"supervisors wait for ({wanted!r}): set the signal with {NVRX_SIGNAL_ENV} or "
            f"{SUBMITIT_SIGNAL_ENV} and the delay with signal_delay_s instead"
        )
    return {**extra, "signal": wanted}
