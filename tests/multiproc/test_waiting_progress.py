"""Long waits say what they wait for: the store host names the node slots it still waits for."""

from __future__ import annotations

import pytest

from tests.multiproc.test_supervisor_local import Job, script


@pytest.mark.timeout(120)
def test_the_store_host_names_the_slots_it_waits_for(tmp_path) -> None:
    # node 0's rank ends at once; node 1's rank only when node 0 has said it waits for it
    marker = tmp_path / "node0-waits"
    body = (
        "import pathlib\n"
        "if RANK == 1:  # a bounded wait for node 0's line, then a clean end\n"
        f"    logs = pathlib.Path({str(tmp_path)!r})\n"
        "    deadline = time.monotonic() + 60\n"
        "    while time.monotonic() < deadline:\n"
        "        text = ''.join(p.read_text() for p in logs.glob('supervisor-*-0.out'))\n"
        "        if 'still waiting for node slot(s) 1 to finish' in text:\n"
        f"            pathlib.Path({str(marker)!r}).touch()\n"
        "            break\n"
        "        time.sleep(0.2)\n"
    )
    job = Job(tmp_path, 2, 1, script(tmp_path, body))
    assert job.wait(100) == [0, 0], job.output()
    assert marker.exists(), job.output()
    assert "of --finish-timeout 300 s" in job.outputs[0].read_text()
