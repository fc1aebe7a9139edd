"""Run a benchmark in a private network namespace, where loopback look-ups cannot stall.

These machines stall reverse-DNS look-ups of 127.0.0.1 for 5 s now and then. A bench
that opens many connections re-runs itself under ``unshare -rn`` (or ``-n`` as root),
with only its own loopback; where that is refused it goes on here with
``RES_OPTIONS`` bounding each look-up. ``NVRX_BENCH_NETNS`` tells which one ran.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

ENV = "NVRX_BENCH_NETNS"


def rerun_inside(script: str, skip: bool = False) -> int | None:
    """Re-run ``script`` with this process's arguments in a private network namespace; its
    exit code, or None to go on in this process (``skip``, already inside, or refused)."""
    if skip or os.environ.get(ENV):
        return None
    inner = " ".join(map(shlex.quote, [sys.executable, os.path.abspath(script), *sys.argv[1:]]))
    if shutil.which("unshare") and shutil.which("ip"):
        for flags, mode in ((["-rn"], "unshare -rn"), (["-n"], "unshare -n")):
            probe = subprocess.run(
                ["unshare", *flags, "sh", "-c", "ip link set lo up"], capture_output=True
            )
            if probe.returncode == 0:
                env = dict(os.environ, **{ENV: mode})
                return subprocess.call(
                    ["unshare", *flags, "sh", "-c", f"ip link set lo up && exec {inner}"], env=env
                )
    os.environ["RES_OPTIONS"] = os.environ.get("RES_OPTIONS", "timeout:1 attempts:1")
    os.environ[ENV] = "none (RES_OPTIONS=" + os.environ["RES_OPTIONS"] + ")"
    return None
