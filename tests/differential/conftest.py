"""The differential tier: runs only where ``.venv-nvrx`` holds the reference (NVRx 0.4.1)."""

from __future__ import annotations

import subprocess
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from differential_harness import REFERENCE_PYTHON, ScenarioTimedOut, free_ports, run

IMPLEMENTATIONS = ("reference", "nvrx")


def _records(
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


@pytest.fixture(scope="session")
def reference_python() -> Path:
    """The reference's interpreter; the tier skips, saying how to set it up, where it cannot
    import ``nvidia_resiliency_ext.inprocess``."""
    if not REFERENCE_PYTHON.exists():
        pytest.skip(f"no {REFERENCE_PYTHON}: run scripts/setup_nvrx_reference.sh (needs the package index)")
    probe = subprocess.run(
        [str(REFERENCE_PYTHON), "-c", "import nvidia_resiliency_ext.inprocess, nvidia_resiliency_ext.fault_tolerance"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(
            f"{REFERENCE_PYTHON} cannot import nvidia_resiliency_ext ({probe.stderr.strip()[-300:]}): "
            "run scripts/setup_nvrx_reference.sh"
        )
    return REFERENCE_PYTHON


@pytest.fixture(scope="session")
def scenario(
    reference_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., dict[str, list[dict[str, Any]]]]:
    """``scenario(script, case, world_size)``: each implementation's records, run once per
    session; the two implementations run at the same time, on ports of their own."""
    done: dict[tuple[str, str, int], dict[str, list[dict[str, Any]]]] = {}

    def records(script: str, case: str = "", world_size: int = 1, timeout: float = 90.0) -> dict[str, Any]:
        key = (script, case, world_size)
        if key not in done:
            tmp = tmp_path_factory.mktemp(f"{Path(script).stem}-{len(done)}")
            ports = [free_ports(3)]
            ports.append(free_ports(3, avoid=range(ports[0], ports[0] + 3)))
            with ThreadPoolExecutor(len(IMPLEMENTATIONS)) as pool:
                futures = {
                    impl: pool.submit(run, impl, script, tmp, case, world_size, timeout, port)
                    for impl, port in zip(IMPLEMENTATIONS, ports, strict=True)
                }

            def again() -> list[dict[str, Any]]:
                return run("reference", script, tmp / "reference-again", case, world_size, timeout, free_ports(3))

            done[key] = _records(futures, again)
        return done[key]

    return records
