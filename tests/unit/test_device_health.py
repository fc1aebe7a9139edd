"""The device health checks (GPU recovery action, NVLinks, InfiniBand ports), and the
reference's ``utils.format_rank_set`` and ``StoreMixin.record_interrupted``."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest
import torch

from nvrx.inprocess import exception
from nvrx.inprocess.attribution import Interruption, InterruptionRecord, interruption_records
from nvrx.inprocess.health_check import (
    ChainedGPUHealthCheck,
    ChainedNicHealthCheck,
    ChainedNVLHealthCheck,
)
from nvrx.inprocess.state import State
from nvrx.inprocess.utils import format_rank_set, format_rank_set_brief, format_rank_set_verbose

STATE = State(rank=0, world_size=1).freeze()


def _port(root: Path, device: str, port: int, downed: int) -> Path:
    counter = root / device / "ports" / str(port) / "counters" / "link_downed"
    counter.parent.mkdir(parents=True, exist_ok=True)
    counter.write_text(f"{downed}\n")
    return counter


def test_nic_check_raises_when_a_link_went_down_since_the_last_check(tmp_path):
    a = _port(tmp_path, "mlx5_0", 1, 3)
    _port(tmp_path, "mlx5_1", 1, 0)
    check = ChainedNicHealthCheck(0, sysfs_root=str(tmp_path))
    assert check(STATE) is STATE  # the first call records the counters
    assert check(STATE) is STATE  # nothing moved
    a.write_text("5\n")
    with pytest.raises(exception.HealthCheckError, match=r"mlx5_0 port 1: 2 time\(s\)"):
        check(STATE)
    assert check(STATE) is STATE  # counted from the last check on


def test_nic_check_passes_without_infiniband(tmp_path, caplog):
    check = ChainedNicHealthCheck(sysfs_root=str(tmp_path / "none"))
    with caplog.at_level(logging.WARNING):
        assert check(STATE) is STATE
        assert check(STATE) is STATE


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: test_gpu_paths runs the checks for real")
def test_gpu_and_nvlink_checks_pass_where_nvml_cannot_run():
    # No pynvml or no driver here: the reference's GPU check would fail every restart.
    assert ChainedGPUHealthCheck()(STATE) is STATE
    assert ChainedGPUHealthCheck(device_index=0)(STATE) is STATE
    assert ChainedNVLHealthCheck(0)(STATE) is STATE


def test_format_rank_set(monkeypatch):
    monkeypatch.delenv("NVRX_LOG_RANK_FORMAT_VERBOSE", raising=False)
    assert format_rank_set([5, 1, 2, 3]) == "{1-3, 5}"
    assert format_rank_set_brief([]) == "{}"
    assert format_rank_set_brief([7]) == "{7}"
    assert format_rank_set_verbose([2, 0, 1]) == "{0, 1, 2}"
    assert format_rank_set_verbose(range(14)) == "{0, 1, 2, 3...12, 13 (total: 14)}"
    monkeypatch.setenv("NVRX_LOG_RANK_FORMAT_VERBOSE", "1")
    assert format_rank_set(range(14)) == "{0, 1, 2, 3...12, 13 (total: 14)}"


def test_record_interrupted_reaches_every_rank_of_the_round():
    from nvrx.inprocess import store as rstore
    from nvrx.store import rounds

    server = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    writer = rstore.round_store(server, 3)
    reader = rstore.round_store(
        torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False), 3
    )
    assert rstore.fault_records(reader) == []
    writer.record_interrupted(
        [InterruptionRecord(2, Interruption.HARD_TIMEOUT), InterruptionRecord(0, Interruption.MONITOR_PROCESS_EXCEPTION)]
    )
    writer.record_interrupted(InterruptionRecord(1, Interruption.EXCEPTION))
    assert reader.get(rounds.INTERRUPTED) == b"fault"
    assert interruption_records(reader) == [
        InterruptionRecord(2, Interruption.HARD_TIMEOUT),
        InterruptionRecord(0, Interruption.MONITOR_PROCESS_EXCEPTION),
        InterruptionRecord(1, Interruption.EXCEPTION),
    ]
