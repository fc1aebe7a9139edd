"""``FaultToleranceConfig``: the hang-detection settings of the launcher-side monitoring.

The names and defaults are those of NVRx's ``fault_tolerance`` package. A
supervisor reads them from a YAML file (``--ft-cfg-path``: the mapping under a
``fault_tolerance`` key, found at any depth) and from ``--ft-<name>`` options,
which win; it hands the result to its children as JSON in ``$NVRX_FT_CONFIG``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class FaultToleranceConfigError(ValueError):
    """A setting or a configuration file is wrong; the message names it."""


#: Fields of NVRx's configuration that nvrx accepts and does not use, with the reason; those
#: of NVRx 0.4.1's dataclass are attributes here too, so code that sets or reads them runs.
IGNORED_FIELDS = {
    "node_health_check_interval": "nvrx runs no periodic node health check in the monitor",
    "restart_check_interval": "a no-op in NVRx too",
    "skip_section_response": "nvrx never waits for an answer to a heartbeat or a section",
    "enable_nic_monitor": "use inprocess.health_check.ChainedNicHealthCheck",
    "enable_nic_healthcheck": "not offered",
    "enable_dist_storage_healthcheck": "not offered",
    "storage_healthcheck_path": "not offered",
    "pci_topo_file": "not offered",
    "link_down_path_template": "not offered",
    "link_state_path_template": "not offered",
    "num_warmup_iterations": "nvrx has no warmup section timeout",
    "install_exception_hook": "not offered",
}


@dataclasses.dataclass
class FaultToleranceConfig:
    """Hang detection of a rank that uses ``RankMonitorClient``; seconds, None = not checked.

    Attributes:
        workload_check_interval: kept for NVRx's configurations; nvrx checks each
            timeout when it falls due instead of polling.
        initial_rank_heartbeat_timeout: from ``init_workload_monitoring()`` to the
            first heartbeat.
        rank_heartbeat_timeout: between two heartbeats.
        rank_section_timeouts: per section name, how long it may stay open.
        rank_out_of_section_timeout: how long a rank may stay outside every section
            (counted from ``init_workload_monitoring()`` or the last section's end).
        safety_factor: computed timeouts are the longest observed time times this.
        rank_termination_signal: what a hung rank's process group receives first;
            SIGKILL follows after the supervisor's ``--grace-period``.
        log_level: of the client's logger (``nvrx.fault_tolerance``).
        node_health_check_interval, restart_check_interval, enable_nic_monitor,
            pci_topo_file, link_down_path_template: NVRx's settings, kept as attributes
            and not used (``IGNORED_FIELDS`` says why).
    """

    workload_check_interval: float = 5.0
    initial_rank_heartbeat_timeout: float | None = None
    rank_heartbeat_timeout: float | None = None
    rank_section_timeouts: dict[str, float | None] = dataclasses.field(default_factory=dict)
    rank_out_of_section_timeout: float | None = None
    safety_factor: float = 5.0
    rank_termination_signal: signal.Signals = signal.SIGKILL
    log_level: int = logging.INFO
    node_health_check_interval: float = 5.0
    restart_check_interval: float = 60.0
    enable_nic_monitor: bool = True
    pci_topo_file: str | None = None
    link_down_path_template: str | None = None

    def __post_init__(self) -> None:
        self.workload_check_interval = _positive("workload_check_interval", self.workload_check_interval)
        for name in ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "rank_out_of_section_timeout"):
            setattr(self, name, _timeout(name, getattr(self, name)))
        if not isinstance(self.rank_section_timeouts, Mapping):
            raise FaultToleranceConfigError(
                f"rank_section_timeouts must map section names to seconds, got {self.rank_section_timeouts!r}"
            )
        self.rank_section_timeouts = {
            str(k): _timeout(f"rank_section_timeouts[{k!r}]", v) for k, v in self.rank_section_timeouts.items()
        }
        self.safety_factor = _at_least_one("safety_factor", self.safety_factor)
        self.rank_termination_signal = parse_signal(self.rank_termination_signal)
        self.log_level = parse_log_level(self.log_level)

    # -- JSON for a child -----------------------------------------------------------
    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["rank_termination_signal"] = self.rank_termination_signal.name
        # the name of a standard level; else the number: "Level 15" parses as neither, and a
        # name a script added (logging.addLevelName) is unknown to the ranks' processes
        name = logging.getLevelName(self.log_level)
        data["log_level"] = name if name in _STANDARD_LEVELS else self.log_level
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> FaultToleranceConfig:
        return cls(**json.loads(text))

    # -- files and options ----------------------------------------------------------
    @classmethod
    def from_kwargs(cls, ignore_not_recognized: bool = True, **kwargs: Any) -> FaultToleranceConfig:
        """A configuration from keyword arguments; unknown names are dropped, or refused with
        ``ignore_not_recognized=False`` (FaultToleranceConfigError, a ValueError), as in NVRx."""
        unknown = sorted(set(kwargs) - set(FIELDS))
        if unknown and not ignore_not_recognized:
            raise FaultToleranceConfigError(
                f"FaultToleranceConfig: unknown setting(s) {unknown} (known: {', '.join(FIELDS)})"
            )
        return cls(**{k: v for k, v in kwargs.items() if k in FIELDS})

    @classmethod
    def from_yaml_file(cls, path: str | Path, ignore_not_recognized: bool = True) -> FaultToleranceConfig:
        """The ``fault_tolerance`` section of a YAML file (needs PyYAML: ``pip install 'nvrx[yaml]'``);
        an unknown setting is dropped with a warning, or refused with ``ignore_not_recognized=False``."""
        return cls(**yaml_section(path, strict=not ignore_not_recognized))

    @classmethod
    def from_args(cls, args: Any) -> FaultToleranceConfig:
        """From parsed launcher options, as NVRx's launcher has them: the YAML file of
        ``args.ft_cfg_path``, then each ``args.ft_<setting>`` that is not None. Unlike NVRx, a
        file that cannot be read is an error, not silently the defaults."""
        options = {name: getattr(args, f"ft_{name}", None) for name in FIELDS}
        if isinstance(options["rank_section_timeouts"], str):
            options["rank_section_timeouts"] = parse_section_timeouts(options["rank_section_timeouts"])
        path = getattr(args, "ft_cfg_path", None)
        if not path and all(v is None for v in options.values()):
            raise FaultToleranceConfigError(
                "no fault tolerance configuration given: neither ft_cfg_path nor any ft_<setting>"
            )
        return cls.from_sources(path, options)

    def to_yaml_file(self, path: str | Path) -> None:
        """Write this configuration as the ``fault_tolerance`` section of a YAML file, which
        ``from_yaml_file`` (here or in NVRx) reads back."""
        yaml = _yaml(path)
        data = dataclasses.asdict(self)
        data["rank_termination_signal"] = self.rank_termination_signal.name
        Path(path).write_text(yaml.safe_dump({"fault_tolerance": data}))

    @classmethod
    def from_sources(
        cls, yaml_path: str | Path | None, options: Mapping[str, Any]
    ) -> FaultToleranceConfig:
        """Defaults, then the YAML file's section, then each option that is not None."""
        values = yaml_section(yaml_path, strict=True) if yaml_path else {}
        values.update({k: v for k, v in options.items() if v is not None})
        return cls(**values)


FIELDS = tuple(f.name for f in dataclasses.fields(FaultToleranceConfig))


def _yaml(path: str | Path) -> Any:
    """The PyYAML module, or FaultToleranceConfigError saying how to install it."""
    try:
        import yaml
    except ImportError:
        raise FaultToleranceConfigError(
            f"--ft-cfg-path {path}: reading YAML needs PyYAML: pip install 'nvrx[yaml]'"
        ) from None
    return yaml


def yaml_section(path: str | Path, strict: bool = True) -> dict[str, Any]:
    """The known fields of the ``fault_tolerance`` mapping in a YAML file; errors name the file.
    An unknown setting is an error when ``strict``, else dropped with a warning."""
    yaml = _yaml(path)
    try:
        document = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise FaultToleranceConfigError(f"--ft-cfg-path {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise FaultToleranceConfigError(f"--ft-cfg-path {path}: not valid YAML: {exc}") from None
    section = _find_section(document)
    if section is None:
        raise FaultToleranceConfigError(f"--ft-cfg-path {path}: no 'fault_tolerance' mapping in the file")
    values = {}
    for key, value in section.items():
        if key in IGNORED_FIELDS:
            log.warning("--ft-cfg-path %s: %r ignored (%s)", path, key, IGNORED_FIELDS[key])
        if key in FIELDS:
            values[key] = value
        elif key in IGNORED_FIELDS:
            continue
        elif strict:
            raise FaultToleranceConfigError(
                f"--ft-cfg-path {path}: unknown setting {key!r} under fault_tolerance "
                f"(known: {', '.join(FIELDS)})"
            )
        else:
            log.warning("%s: unknown setting %r under fault_tolerance ignored", path, key)
    return values


def _find_section(node: Any) -> dict[str, Any] | None:
    if isinstance(node, dict):
        if isinstance(node.get("fault_tolerance"), dict):
            return node["fault_tolerance"]
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = _find_section(child)
        if found is not None:
            return found
    return None


# -- value parsing (shared by the YAML file, the options and the JSON) ----------------
def _number(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FaultToleranceConfigError(f"{name} must be a number of seconds, got {value!r}") from None
    if math.isnan(number) or math.isinf(number):
        raise FaultToleranceConfigError(f"{name} must be a finite number of seconds, got {value!r}")
    return number


def _positive(name: str, value: Any) -> float:
    number = _number(name, value)
    if number <= 0:
        raise FaultToleranceConfigError(f"{name} must be > 0, got {value!r}")
    return number


def _at_least_one(name: str, value: Any) -> float:
    """A factor on an observed time: below 1 a computed timeout would end a rank that
    takes no longer than it was seen to take."""
    number = _number(name, value)
    if not number >= 1:
        raise FaultToleranceConfigError(
            f"{name} must be >= 1 (a timeout shorter than the longest observed time ends healthy "
            f"ranks), got {value!r}"
        )
    return number


def _timeout(name: str, value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return _positive(name, value)


def parse_section_timeouts(text: str) -> dict[str, float | None]:
    """``step:600,checkpoint:1200`` (a timeout may be ``none``)."""
    timeouts: dict[str, float | None] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.rpartition(":")
        if not sep or not name.strip():
            raise FaultToleranceConfigError(
                f"rank_section_timeouts: expected name:seconds pairs separated by commas, got {part!r}"
            )
        timeouts[name.strip()] = _timeout(f"rank_section_timeouts[{name.strip()!r}]", value)
    return timeouts


def parse_signal(value: Any) -> signal.Signals:
    """A signal by name (``SIGTERM`` or ``TERM``) or number."""
    if isinstance(value, signal.Signals):
        return value
    text = str(value).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise FaultToleranceConfigError(
            f"rank_termination_signal must be a signal name or number, got {value!r}"
        ) from None


_STANDARD_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


def parse_log_level(value: Any) -> int:
    """A logging level by name (``DEBUG``) or number."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().upper()
    if text.isdigit():
        return int(text)
    level = logging.getLevelName(text)
    if not isinstance(level, int):
        raise FaultToleranceConfigError(f"log_level must be a logging level name or number, got {value!r}")
    return level


__all__ = ["FaultToleranceConfig", "FaultToleranceConfigError", "parse_section_timeouts"]
