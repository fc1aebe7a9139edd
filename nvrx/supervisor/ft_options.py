"""``--ft-*`` options of ``nvrx-supervise``: launcher-side hang detection (``nvrx.fault_tolerance``).

As NVRx's launcher takes them: ``--ft-cfg-path FILE`` reads the
``fault_tolerance`` section of a YAML file, and each ``--ft-<setting>`` given
overrides the file's value. The result goes to the children as
``$NVRX_FT_CONFIG``; the supervisor checks the timeouts (docs/fault_tolerance.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from nvrx.fault_tolerance.config import (
    FaultToleranceConfig,
    FaultToleranceConfigError,
    parse_section_timeouts,
)

from . import non_retryable
from .config import MAX_SECONDS, ConfigError

#: Setting -> (metavar, help) of its ``--ft-<setting>`` option.
SETTINGS = {
    "initial_rank_heartbeat_timeout": ("S", "seconds from init_workload_monitoring() to the first heartbeat (none: unchecked)"),
    "rank_heartbeat_timeout": ("S", "seconds between two heartbeats (none: unchecked)"),
    "rank_section_timeouts": ("NAME:S,...", "seconds each section may stay open, e.g. step:60,checkpoint:600"),
    "rank_out_of_section_timeout": ("S", "seconds a rank may spend outside every section (none: unchecked)"),
    "safety_factor": ("F", "computed timeouts are the longest observed time times F (default 5)"),
    "rank_termination_signal": ("SIG", "signal a hung rank's process group gets first; SIGKILL follows after --grace-period (default SIGKILL)"),
    "workload_check_interval": ("S", "accepted for NVRx's configurations; nvrx checks each timeout when it falls due"),
    "log_level": ("LEVEL", "log level of the ranks' fault-tolerance client (default INFO)"),
}


def add_options(add: Callable[..., None]) -> None:
    """Register ``--ft-cfg-path`` and every ``--ft-<setting>`` through the CLI's ``add``."""
    add("--ft-cfg-path", default=None, metavar="FILE",
        help="YAML file whose 'fault_tolerance' mapping sets the --ft-* timeouts and settings "
        "(not --ft-restart-policy nor --ft-non-retryable-exception-file: another key there is "
        "an error; needs PyYAML: "
        "pip install 'nvrx[yaml]'); an --ft-<setting> given here wins over the file")  # fmt: skip
    add("--ft-restart-policy", default="auto", metavar="POLICY",
        help="any-failed: a failed rank restarts every rank of every node together, one unit "
        "of --max-restarts; min-healthy: only the failed rank restarts (the in-process Wrapper's "
        "way; with no spare left, --min-nodes says how small the job may get); auto (default): "
        "any-failed for a rank that did not run the in-process Wrapper, min-healthy for one that did")  # fmt: skip
    add("--ft-non-retryable-exception-file", default=None, metavar="FILE",
        help="patterns of failures not worth a restart, one case-sensitive substring a line "
        "(# comments); a failed rank whose exception text (error file or events) holds one stops "
        "the job at once (exit 11)")  # fmt: skip
    for name, (metavar, text) in SETTINGS.items():
        add("--ft-" + name.replace("_", "-"), dest=f"ft_{name}", default=None, metavar=metavar, help=text)


def config_from(args: argparse.Namespace) -> FaultToleranceConfig:
    """The configuration the options (and the YAML file) describe; ConfigError naming a bad one."""
    options = {name: getattr(args, f"ft_{name}") for name in SETTINGS}
    raw_sections = options["rank_section_timeouts"]
    try:
        if raw_sections is not None:
            options["rank_section_timeouts"] = parse_section_timeouts(raw_sections)
        config = FaultToleranceConfig.from_sources(args.ft_cfg_path, options)
    except FaultToleranceConfigError as exc:
        raise ConfigError(f"fault tolerance: {exc}") from exc
    for name, value in _timeouts(config).items():
        if value is not None and value > MAX_SECONDS:
            raise ConfigError(
                f"fault tolerance: {name} must be at most {MAX_SECONDS:g} seconds, got {value:g}"
            )
    return config


def _timeouts(config: FaultToleranceConfig) -> dict[str, float | None]:
    """The timeouts the supervisor waits for, by the name an error gives them (the
    configuration checked that each is finite: here they are bounded as the other options)."""
    return {
        "initial_rank_heartbeat_timeout": config.initial_rank_heartbeat_timeout,
        "rank_heartbeat_timeout": config.rank_heartbeat_timeout,
        "rank_out_of_section_timeout": config.rank_out_of_section_timeout,
        **{f"rank_section_timeouts[{k!r}]": v for k, v in config.rank_section_timeouts.items()},
    }


def non_retryable_patterns(args: argparse.Namespace) -> list[str]:
    """The patterns of ``--ft-non-retryable-exception-file``; ConfigError naming a bad file."""
    if args.ft_non_retryable_exception_file is None:
        return []
    try:
        return non_retryable.load_patterns(args.ft_non_retryable_exception_file)
    except non_retryable.PatternFileError as exc:
        raise ConfigError(str(exc)) from exc
