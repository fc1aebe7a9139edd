"""``FaultToleranceConfig`` from YAML and ``--ft-*`` options: precedence and one-line errors."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys

import pytest

from nvrx.fault_tolerance.config import (
    FaultToleranceConfig,
    FaultToleranceConfigError,
    parse_section_timeouts,
)
from nvrx.supervisor.cli import config_from_args
from nvrx.supervisor.config import ConfigError

COMMAND = ["--", sys.executable, "-c", "pass"]


def _ft(*options: str):
    config, _ = config_from_args([*options, *COMMAND], env={})
    return config.ft


def test_defaults_are_the_references():
    cfg = _ft()
    assert cfg == FaultToleranceConfig()
    assert cfg.workload_check_interval == 5.0
    assert cfg.initial_rank_heartbeat_timeout is None and cfg.rank_heartbeat_timeout is None
    assert cfg.rank_section_timeouts == {} and cfg.rank_out_of_section_timeout is None
    assert cfg.safety_factor == 5.0
    assert cfg.rank_termination_signal is signal.SIGKILL
    assert cfg.log_level == logging.INFO


def test_options_in_both_spellings():
    cfg = _ft(
        "--ft-rank-heartbeat-timeout", "30", "--ft_initial_rank_heartbeat_timeout", "120",
        "--ft-rank-section-timeouts", "step:60, checkpoint:none", "--ft-rank-out-of-section-timeout", "90",
        "--ft-safety-factor", "3", "--ft-rank-termination-signal", "TERM", "--ft-log-level", "debug",
    )  # fmt: skip
    assert cfg.rank_heartbeat_timeout == 30 and cfg.initial_rank_heartbeat_timeout == 120
    assert cfg.rank_section_timeouts == {"step": 60.0, "checkpoint": None}
    assert cfg.rank_out_of_section_timeout == 90 and cfg.safety_factor == 3
    assert cfg.rank_termination_signal is signal.SIGTERM and cfg.log_level == logging.DEBUG


def test_yaml_section_at_any_depth_and_options_win(tmp_path):
    path = tmp_path / "ft.yaml"
    path.write_text(
        "model: {layers: 2}\n"
        "training:\n"
        "  fault_tolerance:\n"
        "    rank_heartbeat_timeout: 45\n"
        "    rank_section_timeouts: {step: 10, checkpoint: 100}\n"
        "    rank_termination_signal: SIGINT\n"
        "    safety_factor: 2.5\n"
        "    enable_nic_monitor: true\n"  # an NVRx setting nvrx does not use: a warning only
    )
    cfg = _ft("--ft-cfg-path", str(path), "--ft-safety-factor", "4")
    assert cfg.rank_heartbeat_timeout == 45
    assert cfg.rank_section_timeouts == {"step": 10.0, "checkpoint": 100.0}
    assert cfg.rank_termination_signal is signal.SIGINT
    assert cfg.safety_factor == 4  # the option wins over the file
    assert FaultToleranceConfig.from_yaml_file(path).safety_factor == 2.5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--ft-rank-heartbeat-timeout", "-1"], "rank_heartbeat_timeout must be > 0, got '-1'"),
        (["--ft-rank-heartbeat-timeout", "soon"], "rank_heartbeat_timeout must be a number of seconds"),
        (["--ft-safety-factor", "0"], "safety_factor must be >= 1"),
        (["--ft-safety-factor", "0.5"], "safety_factor must be >= 1 (a timeout shorter"),
        (["--ft-rank-section-timeouts", "step=5"], "expected name:seconds pairs"),
        (["--ft-rank-termination-signal", "SIGNOPE"], "rank_termination_signal must be a signal name"),
        (["--ft-log-level", "LOUD"], "log_level must be a logging level"),
        (["--ft-cfg-path", "/nonexistent/ft.yaml"], "--ft-cfg-path /nonexistent/ft.yaml: No such file"),
        (["--ft-restart-policy", "some-failed"], "--ft-restart-policy must be auto, any-failed or min-healthy"),
    ],
)
def test_bad_settings_name_themselves(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _ft(*options)


def test_bad_yaml_files_are_named(tmp_path):
    missing = tmp_path / "none.yaml"
    missing.write_text("other: {a: 1}\n")
    with pytest.raises(ConfigError, match="no 'fault_tolerance' mapping"):
        _ft("--ft-cfg-path", str(missing))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("fault_tolerance: {rank_heartbeat_timout: 5}\n")
    with pytest.raises(ConfigError, match="unknown setting 'rank_heartbeat_timout'"):
        _ft("--ft-cfg-path", str(unknown))
    broken = tmp_path / "broken.yaml"
    broken.write_text("fault_tolerance: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        _ft("--ft-cfg-path", str(broken))


def test_yaml_without_pyyaml_says_how_to_install(tmp_path, monkeypatch):
    path = tmp_path / "ft.yaml"
    path.write_text("fault_tolerance: {}\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    with pytest.raises(FaultToleranceConfigError, match=r"pip install 'nvrx\[yaml\]'"):
        FaultToleranceConfig.from_yaml_file(path)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (["--ft-rank-heartbeat-timeout", "-5"], "rank_heartbeat_timeout must be > 0"),
        (["--ft-no-such-option", "1"], "unrecognized arguments: --ft-no-such-option"),
    ],
)
def test_the_command_line_exits_2_with_one_line(options, needle):
    out = subprocess.run(
        [sys.executable, "-m", "nvrx.supervisor", *options, *COMMAND],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_json_round_trip_for_the_children():
    cfg = FaultToleranceConfig(
        rank_heartbeat_timeout=3, rank_section_timeouts={"step": 2}, rank_termination_signal="SIGTERM"
    )
    assert FaultToleranceConfig.from_json(cfg.to_json()) == cfg


def test_section_timeouts_text():
    assert parse_section_timeouts("a:1,b : 2.5 ,c:null,") == {"a": 1.0, "b": 2.5, "c": None}


def test_nvrx_references_constructors_and_yaml_writer(tmp_path):
    """``from_kwargs``, ``from_yaml_file(ignore_not_recognized=)``, ``to_yaml_file`` and ``from_args``, as in NVRx."""
    cfg = FaultToleranceConfig.from_kwargs(rank_heartbeat_timeout=7, not_a_setting=1)
    assert cfg.rank_heartbeat_timeout == 7
    with pytest.raises(ValueError, match="not_a_setting"):
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, not_a_setting=1)
    source = FaultToleranceConfig(
        rank_section_timeouts={"step": 60, "io": None}, rank_termination_signal="SIGTERM",
        log_level="DEBUG", enable_nic_monitor=False,
    )  # fmt: skip
    path = tmp_path / "ft.yaml"
    source.to_yaml_file(path)
    assert FaultToleranceConfig.from_yaml_file(path) == source
    with path.open("a") as f:
        f.write("  not_a_setting: 1\n")
    assert FaultToleranceConfig.from_yaml_file(path) == source  # dropped, with a warning
    with pytest.raises(ValueError, match="unknown setting 'not_a_setting'"):
        FaultToleranceConfig.from_yaml_file(path, ignore_not_recognized=False)
    source.to_yaml_file(path)
    args = argparse.Namespace(ft_cfg_path=str(path), ft_rank_heartbeat_timeout=9.0, ft_rank_section_timeouts="a:1")
    cfg = FaultToleranceConfig.from_args(args)
    assert cfg.rank_heartbeat_timeout == 9.0 and cfg.rank_section_timeouts == {"a": 1.0}
    assert cfg.log_level == logging.DEBUG  # from the file
    with pytest.raises(ValueError, match="no fault tolerance configuration given"):
        FaultToleranceConfig.from_args(argparse.Namespace(ft_cfg_path=None))



def test_every_yaml_only_setting_of_the_docs_is_accepted_with_a_warning_and_ignored(tmp_path, caplog):
    """docs/fault_tolerance.md lists NVRx's settings that nvrx accepts and does not use: each
    is accepted, warned about once, and changes nothing; the list is the code's."""
    from pathlib import Path

    from nvrx.fault_tolerance.config import IGNORED_FIELDS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "fault_tolerance.md").read_text()
    [row] = [line for line in doc.splitlines() if "accepted with a warning and ignored" in line]
    listed = row.split("|")[1].replace("`", "").replace(" ", "").split(",")
    assert sorted(listed) == sorted(IGNORED_FIELDS)
    path = tmp_path / "ft.yaml"
    path.write_text("fault_tolerance:\n" + "".join(f"  {name}: 1\n" for name in listed))
    with caplog.at_level(logging.WARNING, logger="nvrx.fault_tolerance.config"):
        cfg = _ft("--ft-cfg-path", str(path))
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warned) == len(listed), warned
    assert all(any(repr(name) in line for line in warned) for name in listed)
    used = lambda c: {k: v for k, v in json.loads(c.to_json()).items() if k not in IGNORED_FIELDS}  # noqa: E731
    assert used(cfg) == used(_ft())  # NVRx 0.4.1's five are kept as attributes, unused
