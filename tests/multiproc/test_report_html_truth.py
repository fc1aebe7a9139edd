"""Browser tier: the HTML timeline of real jobs tells what happened, as Chromium renders it.

Two real jobs run once per module under local supervisors: the demo job (2 nodes x 2
ranks and a spare node; an exception, a SIGKILLed rank, a hang and the loss of node 1,
whose ranks move to the spare, as ``scripts/demo.sh`` runs it) and a job that fails (a
plain script whose rank 1 raises at every start, until the restart budget is spent).
Chromium screenshots each page (saved under the test's directory and copied to
``SHOTS_DIR`` for people to look at) and dumps its rendered DOM, in which the test
checks the lanes' node labels, the spare move, the dead and hung spans, one mark per
fault and the outcome's colour: by the elements and data attributes the page draws,
never by pixels.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
import test_report_html_browser as browser_tier
from test_report_html_browser import WINDOW, _run, decode_png
from test_supervisor_local import DEMO, Job

from nvrx.report import Report, build_report
from nvrx.report.cli import main

#: Where the screenshots are copied for a person to look at.
SHOTS_DIR = Path(os.environ.get("NVRX_SHOTS_DIR", "/tmp/nvrx-shots"))
#: Tall enough for the first screen, the summary and the timeline under it.
SHOT_WINDOW = (WINDOW[0], 2000)
DEMO_FAULTS = ("exception:15:2", "kill:30:1", "hang:45:3", "node:52:2")
FAILING = (
    "import os, signal\n"
    "def start():\n"
    "    raise RuntimeError('rank 1 cannot start')\n"
    "if os.environ['RANK'] == '1':\n"
    "    start()\n"
    "signal.pause()  # rank 0 waits to be stopped with the job\n"
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(1800)]
#: The browser tier's fixture: Chromium found on PATH, or installed (root with apt-get), else skip.
chromium = browser_tier.chromium


@dataclass
class Rect:
    kind: str
    start: float
    end: float


@dataclass
class LaneDom:
    rank: str
    node: str | None
    hosts: list[str]
    label: str = ""
    rects: list[Rect] = field(default_factory=list)
    moves: list[tuple[str, str]] = field(default_factory=list)
    marks: int = 0


class _Timeline(HTMLParser):
    """The rendered DOM's lanes, their periods, moves and marks, and the outcome shown."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.lanes: dict[str, LaneDom] = {}
        self.outcomes: list[str] = []  # data-outcome of the page's line and the strip
        self._lane: LaneDom | None = None
        self._depth = 0
        self._in_text = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if "outcome" in classes:
            self.outcomes.append(a.get("data-outcome", ""))
        if tag == "g" and classes == ["lane"]:
            hosts = a["data-hosts"].split(",") if a.get("data-hosts") else []
            self._lane, self._depth = LaneDom(a["data-rank"], a.get("data-node"), hosts), 0
            self.lanes[self._lane.rank] = self._lane
            return
        if self._lane is None:
            return
        if tag == "g":
            self._depth += 1
            if "move" in classes:
                self._lane.moves.append((a["data-from"], a["data-to"]))
        elif tag == "rect" and classes and classes[0].startswith("p-"):
            self._lane.rects.append(
                Rect(classes[0][2:], float(a["data-start"]), float(a["data-end"]))
            )
        elif tag == "path" and "fault" in classes:
            self._lane.marks += 1
        elif tag == "text":
            self._in_text = True

    def handle_data(self, data: str) -> None:
        if self._in_text and self._lane is not None:
            self._lane.label += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "text":
            self._in_text = False
        if tag == "g" and self._lane is not None:
            if self._depth == 0:
                self._lane = None
            else:
                self._depth -= 1


@dataclass
class Shown:
    report: Report
    dom: _Timeline
    shot: Path


def _show(chromium: str, job_dir: Path, tmp: Path, name: str) -> Shown:
    """The job's HTML page, its screenshot (also copied to ``SHOTS_DIR``) and rendered DOM."""
    page = tmp / f"{name}.html"
    assert main([str(job_dir), "--format", "html", "-o", str(page), "--no-sacct"]) == 0
    shot = tmp / f"{name}.png"
    width, height = SHOT_WINDOW
    _run(
        chromium,
        tmp / f"{name}-profile",
        f"--screenshot={shot}",
        f"--window-size={width},{height}",
        page.as_uri(),
    )
    SHOTS_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, SHOTS_DIR / shot.name)
    shutil.copy(page, SHOTS_DIR / page.name)
    dom = _Timeline(_run(chromium, tmp / f"{name}-profile2", "--dump-dom", page.as_uri()))
    return Shown(build_report(job_dir, sacct=False), dom, shot)


def _not_blank(shot: Path) -> None:
    w, h, rows = decode_png(shot.read_bytes())
    assert (w, h) == SHOT_WINDOW
    colours = Counter(row[i : i + 3] for row in rows for i in range(0, len(row), 3))
    assert len(colours) >= 20, f"only {len(colours)} colours in {shot}: a blank page?"


@pytest.fixture(scope="module")
def demo(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Shown:
    tmp = tmp_path_factory.mktemp("demo")
    faults = [arg for fault in DEMO_FAULTS for arg in ("--fault", fault)]
    job = Job(
        tmp, 3, 2, [sys.executable, str(DEMO), "--steps", "60", *faults],
        "--spare-nodes", "1", "--max-restarts", "20", "--grace-period", "3", "--node-timeout", "3",
    )  # fmt: skip
    codes = job.wait(300)
    # the lost node's supervisor is SIGKILLed with its processes by the injected node fault
    assert (codes[0], codes[2]) == (0, 0), job.output()
    return _show(chromium, job.log_dir / job.job_id, tmp, "demo-job")


@pytest.fixture(scope="module")
def failed(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Shown:
    tmp = tmp_path_factory.mktemp("failed")
    script = tmp / "failing.py"
    script.write_text(FAILING)
    job = Job(tmp, 1, 2, [sys.executable, str(script)], "--max-restarts", "1", "--redirects", "2")
    codes = job.wait(120)
    assert codes[0] not in (0, None), job.output()
    return _show(chromium, job.log_dir / job.job_id, tmp, "failed-job")


def _spans(lane: LaneDom, kind: str) -> list[Rect]:
    return [r for r in lane.rects if r.kind == kind]


def test_demo_lanes_say_rank_node_and_host_and_the_move_to_the_spare(demo: Shown) -> None:
    _not_blank(demo.shot)
    lanes = demo.dom.lanes
    assert sorted(lanes) == ["0", "1", "2", "3"]
    assert {r: lanes[r].node for r in lanes} == {"0": "0", "1": "0", "2": "1", "3": "1"}
    for rank, lane in lanes.items():
        assert lane.label.startswith(f"rank {rank} · node {lane.node} · "), lane.label
    # node 1's ranks moved to the spare (slot 2) when node 1 was lost; node 0's stayed
    for rank in ("2", "3"):
        assert len(lanes[rank].hosts) == 2 and lanes[rank].moves == [tuple(lanes[rank].hosts)]
        assert "→".join(lanes[rank].hosts) in lanes[rank].label
    assert lanes["0"].moves == lanes["1"].moves == []


def test_demo_dead_rank_is_dead_until_its_replacement_trains(demo: Shown) -> None:
    r = demo.report
    starts = sorted(t.start_wall for t in r.timeline if t.start_wall is not None)
    killed = next(p for p in r.activity.processes if p.rank == 1 and p.ended == "signal SIGKILL")
    (dead,) = _spans(demo.dom.lanes["1"], "dead")
    assert dead.start == pytest.approx(killed.end_wall, abs=1e-3)
    # not when the replacement started: when the first round after its start began
    replacement = next(
        p for p in r.activity.processes if p.rank == 1 and p.start_wall > killed.end_wall
    )
    trained = min(s for s in starts if s > replacement.start_wall)
    assert dead.end == pytest.approx(trained, abs=1e-3) and dead.end > replacement.start_wall
    # and nothing of rank 1 trains while it is dead
    training = _spans(demo.dom.lanes["1"], "training")
    assert not any(t.start < dead.end and t.end > dead.start for t in training)
    # the lost node's ranks: dead from the node's last heartbeat until the spare's trained
    (loss,) = r.node_losses
    for rank in ("2", "3"):
        (gone,) = _spans(demo.dom.lanes[rank], "dead")
        assert gone.start == pytest.approx(loss.start, abs=1e-3)
        assert loss.recovered_wall is not None and gone.end == pytest.approx(
            loss.recovered_wall, abs=1e-3
        )


def test_demo_hang_is_drawn_from_the_ranks_last_progress(demo: Shown) -> None:
    (hang,) = [h for h in demo.report.hangs if h.rank == 3]
    assert hang.wall is not None and hang.stale_s is not None and hang.stale_s > 1.0
    (hung,) = _spans(demo.dom.lanes["3"], "hung")
    assert hung.start == pytest.approx(hang.wall - hang.stale_s, abs=1e-3)
    assert not any(
        t.start < hung.end and t.end > hung.start for t in _spans(demo.dom.lanes["3"], "training")
    )


def test_demo_has_one_mark_per_fault_and_looks_healthy(demo: Shown) -> None:
    faults = [t for t in demo.report.timeline if t.cause is not None]
    assert len(faults) == len(DEMO_FAULTS)
    assert sum(lane.marks for lane in demo.dom.lanes.values()) == len(faults)
    assert demo.dom.outcomes == ["ok", "ok"]  # the answer's outcome line and the timeline's strip


def test_a_failed_job_looks_failed(failed: Shown) -> None:
    _not_blank(failed.shot)
    assert failed.dom.outcomes == ["failed", "failed"]
    lanes = failed.dom.lanes
    assert sorted(lanes) == ["0", "1"] and {lane.node for lane in lanes.values()} == {"0"}
    assert all(lane.label.startswith(f"rank {rank} · node 0 · ") for rank, lane in lanes.items())
    # rank 1 failed at its first start: dead until its replacement trained (the second round)
    assert _spans(lanes["1"], "dead") and lanes["1"].marks >= 1
    # the cause is the exception of its stderr.log, not an exit code
    causes = {t.cause for t in failed.report.timeline if t.cause}
    assert causes == {"RuntimeError at failing.py:3 in start"}, failed.report.to_text()
    # the first screen: both of rank 1's faults, the last one not recovered from
    screen = failed.report.to_text("table", width=None).split("\nSummary\n")[0]
    rows = [line.split() for line in screen.splitlines() if line[:1].isdigit()]
    assert [(row[0], row[2]) for row in rows] == [("1", "exception"), ("2", "exception")], screen
    assert "yes" in rows[0] and rows[1][-2:] == ["no", "-"], screen  # recovered; cost
    assert screen.splitlines()[3].startswith("outcome: FAILED: ")
