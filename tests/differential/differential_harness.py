"""Runs a scenario script of ``scenarios/`` under one implementation and reads back its records.

The reference runs in ``.venv-nvrx`` (``scripts/setup_nvrx_reference.sh``), nvrx in the
interpreter running the tests. A multi-rank scenario gets one process per rank, each
in its own process group, with the environment a launcher gives (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and three consecutive free ports from MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tests.support.ports import free_port_run

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
REFERENCE_PYTHON = ROOT / ".venv-nvrx" / "bin" / "python"
INTERPRETERS = {"nvrx": Path(sys.executable), "reference": REFERENCE_PYTHON}
#: How long one scenario process may run before the test fails on it.
SCENARIO_TIMEOUT_S = 90.0


class ScenarioTimedOut(AssertionError):
    """A rank of a scenario ran past its timeout (it was killed)."""


def free_ports(count: int, avoid: range = range(0)) -> int:
    """A port p such that p .. p+count-1 are free on loopback now and none is in ``avoid``."""
    for _ in range(200):
        base = free_port_run(count)
        if not set(range(base, base + count)) & set(avoid):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found on 127.0.0.1")


def _env(rank: int, world_size: int, port: int, temp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVRX_", "PYTEST_"))}
    env.update(
        TMPDIR=str(temp),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCH_CPP_LOG_LEVEL="ERROR",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore::FutureWarning",
    )
    return env


def run(
    impl: str,
    script: str,
    tmp: Path,
    case: str = "",
    world_size: int = 1,
    timeout: float = SCENARIO_TIMEOUT_S,
    port: int | None = None,
) -> list[dict[str, Any]]:
    """Run ``scenarios/<script>`` with ``case`` as ``world_size`` ranks; each rank's record.
    Every rank must end within ``timeout`` seconds of the start. ``port``: MASTER_PORT (the
    next two must be free too), by default three free ports found now.

    Each rank has a temporary folder of its own (``TMPDIR``); an nvrx rank must leave it
    empty. Raises AssertionError naming the rank and showing its output when a rank does
    not exit 0, writes no record in time or, for nvrx, leaves a file in that folder."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = port or free_ports(3)
    procs, temps = [], []
    for rank in range(world_size):
        temps.append(tmp / f"{impl}-{rank}-tmp")
        temps[-1].mkdir(exist_ok=True)
        log = open(tmp / f"{impl}-{rank}.log", "wb")  # noqa: SIM115 - closed below
        cmd = [str(INTERPRETERS[impl]), str(SCENARIOS / script), impl, str(tmp / f"{impl}-{rank}.json")]
        procs.append((subprocess.Popen(
            cmd + ([case] if case else []), env=_env(rank, world_size, port, temps[-1]),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp,
        ), log))  # fmt: skip
    deadline = time.monotonic() + timeout
    codes = [_reap(proc, log, deadline) for proc, log in procs]
    records = []
    for rank, code in enumerate(codes):
        out = tmp / f"{impl}-{rank}.json"
        if code != 0 or not out.exists():
            text = (tmp / f"{impl}-{rank}.log").read_text(errors="replace")[-4000:]
            failure = ScenarioTimedOut if code is None else AssertionError
            raise failure(f"{impl} {script} {case} rank {rank}: exit {code}, output:\n{text}")
        records.append(json.loads(out.read_text()))
    if impl == "nvrx":
        left = {rank: sorted(p.name for p in temp.iterdir()) for rank, temp in enumerate(temps)}
        assert not any(left.values()), f"nvrx {script} {case} left in its TMPDIR: {left}"
    return records


def both_records(
    futures: dict[str, Future[list[dict[str, Any]]]], again: Callable[[], list[dict[str, Any]]]
) -> dict[str, list[dict[str, Any]]]:
    """Each implementation's records, once both runs ended (their pool was shut down). A
    reference rank that ran past its timeout (seen, rarely, with NVRx 0.4.1 on a loaded
    machine: one rank never exited, its peer ended normally) is the oracle's own fault, not
    nvrx's: the reference runs once more (``again``), alone, with a warning that shows the
    first run's output. nvrx never runs twice, and a failed nvrx run is told first."""
    ours = futures["nvrx"].result()
    try:
        return {"reference": futures["reference"].result(), "nvrx": ours}
    except ScenarioTimedOut as exc:
        warnings.warn(f"the reference ran past its timeout and runs once more: {exc}", stacklevel=1)
        return {"reference": again(), "nvrx": ours}


def _reap(proc: subprocess.Popen[bytes], log: Any, deadline: float) -> int | None:
    """The exit code, or None after killing the process group when it ran past ``deadline``."""
    try:
        return proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def differences(reference: Any, nvrx: Any, path: str = "") -> list[str]:
    """Every place where two records differ, as ``path: reference=... nvrx=...`` lines."""
    if isinstance(reference, dict) and isinstance(nvrx, dict):
        found = []
        for key in sorted(set(reference) | set(nvrx), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in reference or key not in nvrx:
                found.append(f"{sub}: reference={reference.get(key, '<absent>')!r} nvrx={nvrx.get(key, '<absent>')!r}")
            else:
                found.extend(differences(reference[key], nvrx[key], sub))
        return found
    if isinstance(reference, list) and isinstance(nvrx, list) and len(reference) == len(nvrx):
        found = []
        for i, (a, b) in enumerate(zip(reference, nvrx, strict=True)):
            found.extend(differences(a, b, f"{path}[{i}]"))
        return found
    return [] if reference == nvrx else [f"{path}: reference={reference!r} nvrx={nvrx!r}"]
