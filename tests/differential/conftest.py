"""The differential tier: runs only where ``.venv-nvrx`` holds the reference (NVRx 0.4.1)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from differential_harness import REFERENCE_PYTHON, both_records, free_ports, run

IMPLEMENTATIONS = ("reference", "nvrx")


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

            done[key] = both_records(futures, again)
        return done[key]

    return records
