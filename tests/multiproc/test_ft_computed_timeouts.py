"""Section timeouts computed by ranks that did not all open the same sections.

Two gloo ranks report to a real ``RankWatch``; both time ``step``, only rank 0 opens a
``save`` section (the rank that writes the checkpoint), and both then call the default
``calculate_and_set_section_timeouts()``. The collective reduces one list of names, agreed
by every rank, so both put the same timeouts in force.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx import jobenv
from nvrx.fault_tolerance import FaultToleranceConfig
from nvrx.supervisor.rank_watch import RankWatch
from tests.support.ports import free_port_run

REPO = Path(__file__).resolve().parents[2]

RANK = """\
import datetime, json, os, sys, time
import torch.distributed as dist
from nvrx.fault_tolerance import RankMonitorClient

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
client = RankMonitorClient()
client.init_workload_monitoring()
for _ in range(3):
    client.start_section("step"); time.sleep(0.1); client.end_section("step")
    if rank == 0:
        client.start_section("save"); time.sleep(0.3); client.end_section("save")
client.calculate_and_set_section_timeouts()
seen = client._obs.max_section_s  # the longest section this rank measured, by name
print(json.dumps({"timeouts": client.section_timeouts.section, "seen": seen}), flush=True)
client.shutdown_workload_monitoring()
dist.destroy_process_group()
"""


def test_a_section_only_one_rank_opened_gets_one_timeout_on_every_rank(tmp_path: Path) -> None:
    """Before: each rank reduced its own list of names, so rank 1 (no ``save``) took the
    save's maximum for ``step`` and rank 0's collective failed on the lists' lengths."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    watch = RankWatch()
    config = FaultToleranceConfig(rank_section_timeouts={"step": 60}, safety_factor=5)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port_run()), "WORLD_SIZE": "2",
           jobenv.FT_SOCKET: watch.path, jobenv.FT_CONFIG: config.to_json()}  # fmt: skip
    try:
        procs = [
            subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})  # fmt: skip
            for r in range(2)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        watch.close()
    assert [p.returncode for p in procs] == [0, 0], outs
    told = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    sections = [t["timeouts"] for t in told]
    assert sections[0] == sections[1] and set(sections[0]) == {"step", "save"}, told
    # each section's longest time on any rank that opened it, x 5: the step's from the steps
    # alone (not the save's), the save's from rank 0's saves
    seen = [t["seen"] for t in told]
    assert set(seen[0]) == {"step", "save"} and set(seen[1]) == {"step"}, told
    assert sections[0]["step"] == pytest.approx(5 * max(s["step"] for s in seen)), told
    assert sections[0]["save"] == pytest.approx(5 * seen[0]["save"]), told
    assert sections[0]["step"] >= 0.5 and sections[0]["save"] >= 1.5, told  # 0.1 s, 0.3 s x 5
