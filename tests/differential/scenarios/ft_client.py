"""``fault_tolerance``: the configuration, and one rank's ``RankMonitorClient`` from creation to shutdown.

The launcher side is each implementation's real one, started in this process: the
reference's ``RankMonitorServer`` (a subprocess on a Unix socket), nvrx's supervisor
``RankWatch``; the client finds it through the environment its launcher sets. Only the
client's and the configuration's behaviour is recorded: attributes, return values,
exception types, section state and which timeouts are computed (their values depend on
timing and are recorded only as set or not). The record's ``checkpoint`` is the
``state_dict()`` after computing timeouts; ``before_init`` holds, among the calls made
before monitoring starts, what a script started without its launcher sees; with CASE
``load:PATH[,PATH...]`` a new client then loads each checkpoint file (written by either
implementation) before it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import common

SECTIONS = {"step": 600.0, "checkpoint": None}
PUBLIC: Any = None  # the implementation's fault_tolerance package: the names a caller can catch


def attempt(fn: Any) -> Any:
    """``fn()``'s value, or the exception it raised as ``{"raised": type, "catchable_as": [...]}``:
    the classes of its MRO a caller can name in an ``except`` (builtins and the package's own)."""
    try:
        return fn()
    except Exception as exc:  # the type is the outcome
        names = [
            c.__name__ for c in type(exc).__mro__
            if c.__module__ == "builtins" or getattr(PUBLIC, c.__name__, None) is c
        ]  # fmt: skip
        return {"raised": type(exc).__name__, "catchable_as": names}


def shape(value: Any) -> Any:
    """``value`` with every number replaced by ``"<number>"`` (computed ones differ between runs)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): shape(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(shape(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [shape(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "<number>"
    return value


def config_record(ft: Any, tmp: Path) -> dict[str, Any]:
    cfg_cls = ft.FaultToleranceConfig
    names = [f.name for f in dataclasses.fields(cfg_cls)]

    def fields(cfg: Any) -> dict[str, Any]:
        return {n: getattr(cfg, n) for n in names}

    nested = tmp / "nested.yaml"
    nested.write_text(
        "model: {layers: 2}\ntrainer:\n  fault_tolerance:\n    rank_heartbeat_timeout: 30\n"
        "    rank_section_timeouts: {step: 60, checkpoint: null}\n    safety_factor: 2.5\n"
        "    rank_termination_signal: SIGTERM\n    log_level: DEBUG\n    not_a_setting: 1\n"
    )
    written = tmp / "written.yaml"
    record = {
        "fields": names,
        "defaults": fields(cfg_cls()),
        "from_kwargs": attempt(lambda: fields(cfg_cls.from_kwargs(rank_heartbeat_timeout=7, x=1))),
        "from_kwargs_strict": attempt(lambda: cfg_cls.from_kwargs(ignore_not_recognized=False, x=1)),
        "from_yaml_nested": attempt(lambda: fields(cfg_cls.from_yaml_file(str(nested)))),
        "from_yaml_strict": attempt(lambda: cfg_cls.from_yaml_file(str(nested), ignore_not_recognized=False)),
        "signal_by_name": attempt(lambda: cfg_cls(rank_termination_signal="SIGUSR1").rank_termination_signal),
        "signal_by_number": attempt(lambda: cfg_cls(rank_termination_signal=15).rank_termination_signal),
        "bad_signal": attempt(lambda: cfg_cls(rank_termination_signal="SIGNOPE")),
        "level_by_name": attempt(lambda: cfg_cls(log_level="warning").log_level),
        "bad_level": attempt(lambda: cfg_cls(log_level="LOUD")),
    }
    source = cfg_cls(rank_heartbeat_timeout=12.5, rank_section_timeouts={"a": 3.0}, rank_termination_signal=signal.SIGTERM)
    source.to_yaml_file(str(written))
    record["yaml_round_trip"] = fields(cfg_cls.from_yaml_file(str(written))) == fields(source)
    return record


@contextlib.contextmanager
def launcher_side(impl: str, cfg: Any) -> Any:
    """The implementation's own rank monitor for this process, as its launcher would start it."""
    if impl == "reference":
        import torch.multiprocessing

        server_module = common.module(impl, "fault_tolerance.rank_monitor_server")
        with tempfile.TemporaryDirectory(dir="/tmp") as folder:  # a short path for the socket
            path = os.path.join(folder, "rmon.socket")
            proc = server_module.RankMonitorServer.run_in_subprocess(cfg, path, mp_ctx=torch.multiprocessing)
            os.environ["FT_RANK_MONITOR_IPC_SOCKET"] = path
            try:
                yield
            finally:
                proc.terminate()
                proc.join(30)
    else:
        from nvrx.supervisor.rank_watch import RankWatch

        watch = RankWatch()
        os.environ["NVRX_FT_SOCKET"] = watch.path
        os.environ["NVRX_FT_CONFIG"] = cfg.to_json()
        stop_r, stop_w = os.pipe()
        reader = threading.Thread(target=serve, args=(watch, stop_r), daemon=True)
        reader.start()
        try:
            yield
        finally:
            os.write(stop_w, b"x")
            reader.join(30)
            watch.close()
            os.close(stop_r)
            os.close(stop_w)


def serve(watch: Any, stop_fd: int) -> None:
    """What nvrx's supervisor does with its ``RankWatch``: accept and read until told to stop."""
    while True:
        ready, _, _ = select.select([watch, stop_fd, *watch.connection_fds()], [], [])
        if stop_fd in ready:
            return
        if watch in ready:
            watch.accept()
        for fd in ready:
            if isinstance(fd, int) and fd != stop_fd:
                watch.read(fd)


def client_view(client: Any) -> dict[str, Any]:
    return {
        "is_initialized": client.is_initialized,
        "hb_timeouts": shape(client.hb_timeouts),
        "section_timeouts": shape(client.section_timeouts),
    }


def monitored(ft: Any, client: Any) -> dict[str, Any]:
    """Heartbeats, sections and computed timeouts of one initialized client."""
    steps: dict[str, Any] = {"after_init": client_view(client)}
    steps["calc_without_process_group"] = attempt(
        lambda: client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
    )
    init_process_group()
    steps["hb_not_ready"] = attempt(lambda: client.calculate_and_set_hb_timeouts(skip_if_not_ready=True))
    steps["hb_not_ready_raises"] = attempt(client.calculate_and_set_hb_timeouts)
    for _ in range(3):
        client.send_heartbeat()
    steps["end_unopened_section"] = attempt(lambda: client.end_section("step"))
    steps["hb_computed"] = attempt(client.calculate_and_set_hb_timeouts)
    steps["after_hb"] = client_view(client)
    steps["sections_not_ready"] = attempt(
        lambda: client.calculate_and_set_section_timeouts(skip_if_not_ready=True)
    )
    client.start_section("step")
    client.start_section("checkpoint")
    client.end_section("checkpoint")
    client.end_section("step")
    client.start_section("step")
    steps["start_open_section"] = attempt(lambda: client.start_section("step"))
    client.end_all_sections()
    steps["step_only"] = attempt(
        lambda: client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False)
    )
    steps["after_step_only"] = client_view(client)
    steps["sections_computed"] = attempt(client.calculate_and_set_section_timeouts)
    steps["after_sections"] = client_view(client)
    steps["checkpoint"] = client.state_dict()
    steps["checkpoint_shape"] = shape(steps["checkpoint"])
    steps["unknown_section"] = attempt(lambda: client.start_section("not_configured"))
    return steps


def loaded(ft: Any, checkpoint: Path) -> dict[str, Any]:
    """A new client (as after a restart) that loads ``checkpoint`` before monitoring starts."""
    client = ft.RankMonitorClient()
    view = {"load": attempt(lambda: client.load_state_dict(json.loads(checkpoint.read_text())))}
    view["init"] = attempt(client.init_workload_monitoring)
    view.update(client_view(client))
    view["saved_again"] = shape(client.state_dict())
    client.shutdown_workload_monitoring()
    return view


def init_process_group() -> None:
    """A one-rank gloo group: the calculations are collectives in the reference."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def main() -> int:
    impl, out, case = common.arguments()
    global PUBLIC
    ft = PUBLIC = common.module(impl, "fault_tolerance")
    with tempfile.TemporaryDirectory() as tmp:
        record: dict[str, Any] = {"config": config_record(ft, Path(tmp))}
    client = ft.RankMonitorClient()
    record["fresh"] = client_view(client)
    record["public"] = {
        "RankMonitorClient": sorted(n for n in dir(client) if not n.startswith("_")),
        "FaultToleranceConfig": sorted(n for n in dir(ft.FaultToleranceConfig()) if not n.startswith("_")),
        "WorkloadAction": {a.name: a.value for a in ft.WorkloadAction},
        "WorkloadControlRequest": sorted(vars(ft.WorkloadControlRequest(ft.WorkloadAction.Continue))),
    }
    record["before_init"] = {
        "send_heartbeat": attempt(client.send_heartbeat),
        "start_section": attempt(lambda: client.start_section("step")),
        "calculate_and_set_hb_timeouts": attempt(client.calculate_and_set_hb_timeouts),
        "shutdown_workload_monitoring": attempt(client.shutdown_workload_monitoring),
        "state_dict": attempt(lambda: shape(ft.RankMonitorClient().state_dict())),
        "load_unknown_mapping": attempt(lambda: ft.RankMonitorClient().load_state_dict({"nope": 1})),
        "load_empty_mapping": attempt(lambda: ft.RankMonitorClient().load_state_dict({})),
        # a script started without its launcher (plain python, torchrun): no rank monitor
        "init_without_launcher": attempt(ft.RankMonitorClient().init_workload_monitoring),
        "workload_control_without_launcher": attempt(
            lambda: ft.RankMonitorClient().send_workload_control_request(
                ft.WorkloadControlRequest(ft.WorkloadAction.ShutdownWorkload, "stop")
            )
        ),
    }
    cfg = ft.FaultToleranceConfig(
        initial_rank_heartbeat_timeout=300, rank_heartbeat_timeout=300,
        rank_section_timeouts=SECTIONS, rank_out_of_section_timeout=300, safety_factor=5.0,
    )  # fmt: skip
    with launcher_side(impl, cfg):
        record["init"] = attempt(client.init_workload_monitoring)
        record["init_twice"] = attempt(client.init_workload_monitoring)
        record["cfg_after_init"] = {
            "type": type(client.cfg).__name__,
            "rank_section_timeouts": client.cfg.rank_section_timeouts,
            "safety_factor": client.cfg.safety_factor,
        }
        record["monitored"] = monitored(ft, client)
        record["shutdown"] = attempt(client.shutdown_workload_monitoring)
        record["after_shutdown"] = {"is_initialized": client.is_initialized}
        record["loaded"] = [loaded(ft, Path(p)) for p in case.removeprefix("load:").split(",") if p]
    common.write(out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
