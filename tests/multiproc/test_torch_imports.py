"""Which processes of a job import torch: the ranks, the store service and the warm standbys,
and none of the helpers (a rank's monitor, the supervisor's node agents), which talk to the
store through nvrx's own client. Each import of torch costs a node about 1.5 s of CPU and
200 MB, at the moment the whole job starts.

Every Python process of the job is seen through a ``sitecustomize`` module put first on its
``PYTHONPATH``: it writes one line when the process starts and one when it imports torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from nvrx.inprocess.monitor_process import ENTRY_POINT

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart_train.py"

SPY = textwrap.dedent(
    """
    import json, os, sys

    def _line(kind):
        with open(os.environ["NVRX_TEST_IMPORT_LOG"], "a") as out:
            out.write(json.dumps({"kind": kind, "pid": os.getpid(), "argv": sys.orig_argv}) + "\\n")

    _line("start")
    _seen = []

    def _hook(event, args):
        if event == "import" and args[0] == "torch" and not _seen:
            _seen.append(1)
            _line("torch")

    sys.addaudithook(_hook)
    """
)


def _role(argv: list[str]) -> str:
    text = " ".join(argv)
    if ENTRY_POINT in text or "main_prestarted" in text:
        return "monitor"
    for role, mark in (
        ("rank", QUICKSTART.name), ("node agent", "nvrx.node_agent"),
        ("store service", "store.service"), ("standby", "standby"), ("supervisor", "nvrx-supervise"),
    ):  # fmt: skip
        if mark in text:
            return role
    return "other: " + text[:200]


def test_only_ranks_store_services_and_standbys_import_torch(tmp_path: Path) -> None:
    spy_dir = tmp_path / "spy"
    spy_dir.mkdir()
    (spy_dir / "sitecustomize.py").write_text(SPY)
    log = tmp_path / "imports.jsonl"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(spy_dir), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        NVRX_TEST_IMPORT_LOG=str(log),
    )
    supervise = Path(sys.executable).with_name("nvrx-supervise")
    done = subprocess.run(
        [str(supervise), "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
         "--", sys.executable, str(QUICKSTART)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "20 steps done in round 1" in done.stdout, done.stdout[-3000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    roles = {line["pid"]: _role(line["argv"]) for line in lines if line["kind"] == "start"}
    started = sorted(roles.values())
    with_torch = sorted(roles[line["pid"]] for line in lines if line["kind"] == "torch")
    # the helpers ran: two monitors at least (one per rank), a node agent
    assert started.count("monitor") >= 2 and "node agent" in started, started
    assert set(with_torch) <= {"rank", "store service", "standby"}, (with_torch, started)
    assert with_torch.count("rank") == 2, with_torch
