"""``nvrx-report --format html``: one self-contained page, its SVG timeline, links and escaping.

Event logs are written with the real ``EventWriter`` (``test_report_fixtures``); the
page is read back with ``html.parser`` and its SVG with ``xml.etree`` (it must be
well-formed XML). The browser's view of the page is ``tests/multiproc/test_report_html_browser.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_report_fixtures import HANG_STACK, JOB, USER_TRACEBACK, Host, Proc, write_standard_job
from test_report_node_loss import LAST_SEEN, _spare_job

from nvrx.report import Report, build_report
from nvrx.report.cli import _parser, main
from nvrx.report.html_lanes import MAX_RANK_LANES
from nvrx.report.html_timeline import PLOT_W
from nvrx.report.model import SpareSpan
from nvrx.report.text_doc import secs, when

EVIL = "<script>alert('owned')</script>"
_URL_ATTRS = ("src", "href", "xlink:href", "action", "data", "poster", "formaction", "background")


class Page(HTMLParser):
    """Every start tag with its attributes, and the text of each element with an id."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.by_id: dict[str, str] = {}
        self.id_tags: dict[str, str] = {}
        self._open: list[tuple[str, str, list[str]]] = []  # (tag, id, text) of open elements with an id
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.tags.append((tag, found))
        if found.get("id"):
            self._open.append((tag, str(found["id"]), []))
            self.id_tags[str(found["id"])] = tag

    def handle_endtag(self, tag: str) -> None:
        if self._open and self._open[-1][0] == tag:
            _, ident, text = self._open.pop()
            self.by_id[ident] = "".join(text)

    def handle_data(self, data: str) -> None:
        for _, _, text in self._open:
            text.append(data)


def _svg(page: str) -> ET.Element:
    found = re.findall(r"<svg\b.*?</svg>", page, flags=re.S)
    assert len(found) == 1, f"expected one <svg> timeline, found {len(found)}"
    return ET.fromstring(found[0])  # raises when the SVG is not well-formed


def _lanes(svg: ET.Element) -> dict[str, ET.Element]:
    """Rank (or node) lanes by their data-rank (data-node); spare lanes left out."""
    out = {}
    for g in svg.iter("g"):
        classes = (g.get("class") or "").split()
        if "lane" in classes and "spare" not in classes:
            out[g.get("data-rank") or g.get("data-node") or "?"] = g
    return out


def _kinds(lane: ET.Element) -> set[str]:
    """Period kinds drawn on a lane (``p-training`` ... classes of its rects)."""
    return {
        r.get("class", "")[2:] for r in lane.iter("rect") if r.get("class", "").startswith("p-")
    }


def _marks(lane: ET.Element) -> list[tuple[str, str]]:
    """(href, tooltip) of each fault mark of a lane."""
    out = []
    for a in lane.iter("a"):
        path = a.find("path")
        if path is not None and path.get("class") == "fault":
            title = path.find("title")
            out.append((a.get("href", ""), title.text if title is not None else ""))
    return out


@pytest.fixture(scope="module")
def standard(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, str]:
    job_dir = tmp_path_factory.mktemp("std") / JOB
    write_standard_job(job_dir)
    report = build_report(job_dir, sacct=False)
    return report, report.to_text("html")


def test_the_page_fetches_nothing(standard: tuple[Report, str]) -> None:
    _, page = standard
    parsed = Page(page)
    for tag, attrs in parsed.tags:
        assert tag != "link", f"<link {attrs}>: the page must not load stylesheets or icons"
        assert tag not in ("iframe", "object", "embed", "img"), tag
        for name in _URL_ATTRS:
            value = (attrs.get(name) or "").strip()
            if value:
                assert value.startswith("#"), f"<{tag} {name}={value!r}>: only links inside the page"
        if tag == "script":
            assert "src" not in attrs, "<script src=...>: scripts must be inline"
    assert sum(1 for tag, _ in parsed.tags if tag == "script") == 1  # the few lines that open blocks
    lowered = page.lower()
    for needle in ("http://", "https://", "url(", "@import", "//cdn"):
        assert needle not in lowered, needle
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")


def test_one_lane_per_rank_with_its_label(standard: tuple[Report, str]) -> None:
    report, page = standard
    lanes = _lanes(_svg(page))
    assert sorted(lanes) == [str(r) for r in range(report.summary.ranks)] == ["0", "1", "2", "3"]
    for rank, g in lanes.items():  # its node rank and host too: 2 ranks a node
        node, host = int(rank) // 2, ("node-a", "node-b")[int(rank) // 2]
        labels = [t.text for t in g.iter("text")]
        assert labels == [f"rank {rank} · node {node} · {host}"]
        assert (g.get("data-node"), g.get("data-hosts")) == (str(node), host)


def test_lanes_show_training_restarts_the_killed_process_and_the_hang(
    standard: tuple[Report, str],
) -> None:
    _, page = standard
    lanes = _lanes(_svg(page))
    for rank in "0123":  # 3 in-process restarts: every rank trains and restarts
        assert {"training", "restart"} <= _kinds(lanes[rank]), rank
    # rank 1's process was SIGKILLed and relaunched (20.1 -> 20.6 s): dead in between
    assert [r for r in lanes if "dead" in _kinds(lanes[r])] == ["1"]
    dead = [
        r.find("title").text  # type: ignore[union-attr]
        for r in lanes["1"].iter("rect")
        if r.get("class") == "p-dead"
    ]
    assert len(dead) == 1 and "signal SIGKILL" in dead[0] and "0.500 s" in dead[0]
    # rank 3 hung from the hang report (45.0 s) until its round ended
    assert [r for r in lanes if "hung" in _kinds(lanes[r])] == ["3"]


def test_every_fault_is_marked_on_its_rank_and_links_to_its_traceback(
    standard: tuple[Report, str],
) -> None:
    report, page = standard
    parsed = Page(page)
    lanes = _lanes(_svg(page))
    marks = {rank: _marks(g) for rank, g in lanes.items()}
    assert {rank: len(m) for rank, m in marks.items()} == {"0": 1, "1": 1, "2": 1, "3": 1}
    expected = {
        "0": ("TimeoutError", "barrier"),
        "1": ("signal SIGKILL", "local rank 1 ended"),
        "2": ("ValueError at train.py:12 in step", "raise ValueError('bad batch 17')"),
        "3": ("hang (soft timeout)", "all_reduce_grads"),
    }
    for rank, [(href, tip)] in marks.items():
        signature, body = expected[rank]
        assert tip.startswith(f"{signature}: rank {rank}"), tip
        ident = href.removeprefix("#")
        assert parsed.id_tags.get(ident) == "details", f"{href} leads to no <details> block"
        assert signature in parsed.by_id[ident] and body in parsed.by_id[ident]
    assert len(report.activity.faults) == 4
    # the hung period links to the stack of its hang
    hung = [a for a in lanes["3"].iter("a") if a.find("rect") is not None]
    assert [a.get("href") for a in hung] == ["#hang-0"]
    assert HANG_STACK.splitlines()[1].strip() in parsed.by_id["hang-0"]


def test_summary_and_tables_hold_the_reports_values(standard: tuple[Report, str]) -> None:
    report, page = standard
    parsed = Page(page)
    s = report.summary
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
    for key, value in [
        ("ranks", str(s.ranks)),
        ("wall time", secs(s.wall_time_s)),
        ("training time (per rank)", secs(s.training_time_s)),
        ("goodput", f"{s.goodput * 100:.1f} %" if s.goodput is not None else "-"),
        ("in-process restarts", str(s.restarts.in_process)),
        ("process restarts", str(s.restarts.process)),
        ("outcome", s.outcome),
    ]:
        assert f" {key} {value} " in text, (key, value)
    assert (s.ranks, s.restarts.in_process, s.restarts.process, s.outcome) == (4, 3, 1, "completed")
    for heading in ("Job timeline", "Restart timeline", "Failures by signature", "Hangs",
                    "Process restarts", "Suspect nodes", "Read"):  # fmt: skip
        assert f"<h2>{heading}</h2>" in page, heading
    # the failures table links each signature to its block
    links = [a.get("href") for tag, a in parsed.tags if tag == "a" and a.get("href", "").startswith("#fault-")]
    for i in range(len(report.failures)):
        assert f"#fault-{i}" in links and parsed.id_tags[f"fault-{i}"] == "details"


def _evil_job(log_dir: Path) -> None:
    """One host, two ranks; event texts carrying markup: host name, exception, traceback,
    hang timeout and stack (the host and the timeout reach the SVG's tooltips)."""
    host = Host(f"evil{EVIL}host", 0)
    sup = Proc(log_dir, host, "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=2, command="python train.py")
    ranks = {r: Proc(log_dir, host, "wrapper", rank=r) for r in (0, 1)}
    for r, p in ranks.items():
        sup.at(0.5, "child_start", local_rank=r, child_pid=10 + r, attempt=0)
        p.round(0).at(1.0, "round_start", world_size=2, active_world_size=2, active_rank=r, initial_rank=r)
    ranks[0].at(
        5.0, "fault", fault_kind="exception", origin_rank=0, exc_type="EvilError", message=EVIL,
        traceback=f'Traceback (most recent call last):\n  File "/home/u/train.py", line 3, in f\n'
        f"    x()\nEvilError: {EVIL}</pre></details><img src=x onerror=alert(1)>\n",
    )  # fmt: skip
    ranks[1].at(5.1, "fault", fault_kind="peer", origin_rank=0, message=EVIL)
    monitor = Proc(log_dir, host, "monitor", rank=1)
    monitor.round(0).at(4.0, "hang", timeout=f"soft{EVIL}", stack=f"Thread 1:\n  File \"{EVIL}.py\", line 1")
    for r, p in ranks.items():
        p.at(6.0, "round_end", outcome="error", duration_s=5.0)
        sup.at(6.5, "child_exit", local_rank=r, child_pid=10 + r, exit_code=1, signal=None, runtime_s=6.0)
    sup.at(7.0, "supervisor_end", exit_code=1, reason=EVIL)
    for p in [sup, monitor, *ranks.values()]:
        p.close()


def test_event_text_is_escaped(tmp_path: Path) -> None:
    _evil_job(tmp_path / "evil")
    page = build_report(tmp_path / "evil", sacct=False).to_text("html")
    assert EVIL not in page and "<img" not in page and "onerror=alert(1)>" not in page
    assert "&lt;script&gt;alert(&#x27;owned&#x27;)&lt;/script&gt;" in page
    parsed = Page(page)
    assert sum(1 for tag, _ in parsed.tags if tag == "script") == 1  # only the page's own
    assert not any(tag == "img" for tag, _ in parsed.tags)
    svg = _svg(page)  # the SVG's tooltips carry the texts too: still well-formed
    assert sorted(_lanes(svg)) == ["0", "1"]
    tips = [t.text or "" for t in svg.iter("title")]
    assert any(EVIL in tip and tip.startswith("rank 1 · ") and ": hung (" in tip for tip in tips)
    assert any(f"evil{EVIL}host" in tip for tip in tips)  # a fault mark's host
    (ident,) = [h.removeprefix("#") for h, tip in _marks(_lanes(svg)["0"]) if tip.startswith("EvilError")]
    assert EVIL in parsed.by_id[ident]  # shown as text, in its block


def test_cli_writes_the_page_to_the_output_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_standard_job(tmp_path / JOB)
    out = tmp_path / "report.html"
    assert main([str(tmp_path / JOB), "--format", "html", "-o", str(out), "--no-sacct"]) == 0
    assert capsys.readouterr().out == ""
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and sorted(_lanes(_svg(page))) == ["0", "1", "2", "3"]
    missing = tmp_path / "no" / "such" / "dir" / "report.html"
    assert main([str(tmp_path / JOB), "--format", "html", "-o", str(missing), "--no-sacct"]) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and "directory" in err


def test_help_tells_the_html_format_and_the_output_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    text = _parser().format_help()
    assert "{table,json,markdown,html}" in text
    assert "html: one self-contained page" in text and "-o FILE, --output FILE" in text
    assert "with --format html: the page to open in a browser" in text


def test_a_lost_node_its_spare_and_the_dead_time_between(tmp_path: Path) -> None:
    report = _spare_job(tmp_path / "job", {0: "vm", 1: "vm", 2: "vm"})
    page = report.to_text("html")
    svg = _svg(page)
    lanes = _lanes(svg)
    assert sorted(lanes) == ["0", "1", "2", "3"]
    # ranks 2-3 died with slot 1 (last seen 11.4 s) until the spare's children started
    assert [r for r in lanes if "dead" in _kinds(lanes[r])] == ["2", "3"]
    # one loss, one mark: on the lost node's first rank
    [(href, tip)] = _marks(lanes["2"])
    assert tip.startswith("node lost: rank 2") and href == "#fault-0"
    assert _marks(lanes["3"]) == []
    spares = [g for g in svg.iter("g") if g.get("class") == "lane spare"]
    assert [g.get("data-slot") for g in spares] == ["2"]
    assert _kinds(spares[0]) == {"spare"}
    (tip,) = [r.find("title").text for r in spares[0].iter("rect") if r.get("class") == "p-spare"]  # type: ignore[union-attr]
    assert "took over node rank 1" in tip
    lost = [p for p in report.activity.processes if p.ended == "node lost"]
    assert sorted(p.rank for p in lost) == [2, 3] and all(
        p.end_wall == pytest.approx(report.node_losses[0].start) for p in lost
    )
    assert report.node_losses[0].start == pytest.approx(1_700_000_000.0 + LAST_SEEN)


def _requeued_job(log_dir: Path) -> None:
    """One node, two ranks, no Wrapper: run 0 (0-40 s) preempted and requeued, run 1 (100-150 s)."""
    host = Host("h", 0)
    for run, t0 in ((0, 0.0), (1, 100.0)):
        sup = Proc(log_dir, host, "supervisor")
        sup.at(t0, "supervisor_start", nnodes=1, nproc_per_node=2, command="python train.py")
        for r in (0, 1):
            sup.at(t0 + 1.0, "child_start", local_rank=r, child_pid=50 + r + 10 * run, attempt=0)
        end, code = (40.0, 143) if run == 0 else (150.0, 0)
        if run == 0:  # preempted: the job stops, its processes end as part of the stop
            sup.at(38.5, "job_stop", reason="preempted: requeued", exit_code=143)
        for r in (0, 1):
            sup.at(t0 + end - t0 - 1.0, "child_exit", local_rank=r, child_pid=50 + r + 10 * run,
                   exit_code=code, signal=None, runtime_s=end - t0 - 2.0)  # fmt: skip
        if run == 0:
            sup.at(39.5, "requeue", cause="preemption", count=1)
        sup.at(end, "supervisor_end", exit_code=0 if run else 143, reason="done" if run else "requeued")
        sup.close()


def test_a_requeue_is_a_band_across_the_lanes(tmp_path: Path) -> None:
    _requeued_job(tmp_path / "rq")
    report = build_report(tmp_path / "rq", sacct=False)
    assert [(r.run, r.end_wall - r.start_wall) for r in report.activity.runs] == [(0, 40.0), (1, 50.0)]  # type: ignore[operator]
    svg = _svg(report.to_text("html"))
    bands = [r for r in svg.iter("rect") if r.get("class") == "requeue-band"]
    assert len(bands) == 1 and "requeued: run 1 started 60.0 s later" in bands[0].find("title").text  # type: ignore[union-attr]
    lanes = _lanes(svg)
    assert sorted(lanes) == ["0", "1"] and all(_kinds(g) == {"training"} for g in lanes.values())


def test_many_ranks_get_one_lane_per_node(tmp_path: Path) -> None:
    """2 nodes x 130 ranks (supervisor events only): 260 > MAX_RANK_LANES ranks, 2 lanes."""
    nproc = 130
    assert 2 * nproc > MAX_RANK_LANES
    for node in (0, 1):
        sup = Proc(tmp_path / "big", Host(f"big-{node}", node), "supervisor")
        sup.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=nproc, command="python train.py")
        for local in range(nproc):
            sup.at(1.0, "child_start", local_rank=local, child_pid=1000 + local, attempt=0)
        if node == 1:
            sup.at(20.0, "child_exit", local_rank=5, child_pid=1005, exit_code=None, signal="SIGKILL", runtime_s=19.0)
            sup.at(20.1, "restart_decision", local_rank=5, decision="restart", reason="killed")
            sup.at(22.0, "child_start", local_rank=5, child_pid=2005, attempt=1)
        for local in range(nproc):
            pid = 2005 if (node, local) == (1, 5) else 1000 + local
            sup.at(50.0, "child_exit", local_rank=local, child_pid=pid, exit_code=0, signal=None, runtime_s=49.0)
        sup.at(51.0, "supervisor_end", exit_code=0, reason="all children exited 0")
        sup.close()
    report = build_report(tmp_path / "big", sacct=False)
    svg = _svg(report.to_text("html"))
    lanes = _lanes(svg)
    assert sorted(lanes) == ["0", "1"]
    assert [t.text for t in lanes["1"].iter("text")] == ["node 1 · big-1"]
    assert "dead" in _kinds(lanes["1"]) and "dead" not in _kinds(lanes["0"])
    assert [tip.split(":")[0] for _, tip in _marks(lanes["1"])] == ["signal SIGKILL"]
    assert not _marks(lanes["0"])


def _periods(lane: ET.Element, kind: str) -> list[str]:
    """Tooltips of a lane's periods of one kind."""
    return [
        r.find("title").text or ""  # type: ignore[union-attr]
        for r in lane.iter("rect")
        if r.get("class") == f"p-{kind}"
    ]


def test_restart_starts_at_the_detection_and_an_unreplaced_failure_stays_dead(tmp_path: Path) -> None:
    """Round 0 ends at 10 s reporting a 6 s restart latency; round 1 starts at 12 s: the
    restart period is 6-12 s. Rank 1's process is SIGKILLed at 15 s and not replaced."""
    host = Host("h", 0)
    sup = Proc(tmp_path / "lat", host, "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=2, command="python train.py")
    ranks = {r: Proc(tmp_path / "lat", host, "wrapper", rank=r) for r in (0, 1)}
    for r, p in ranks.items():
        sup.at(0.5, "child_start", local_rank=r, child_pid=10 + r, attempt=0)
        p.round(0).at(1.0, "round_start", world_size=2, active_world_size=2, active_rank=r, initial_rank=r)
    ranks[0].at(6.0, "fault", fault_kind="exception", origin_rank=0, exc_type="ValueError", message="x")
    for r, p in ranks.items():
        p.at(10.0, "round_end", outcome="restart", duration_s=9.0, restart_latency_s=6.0)
        p.round(1).at(12.0, "round_start", world_size=2, active_world_size=2, active_rank=r, initial_rank=r)
    sup.at(15.0, "child_exit", local_rank=1, child_pid=11, exit_code=None, signal="SIGKILL", runtime_s=14.5)
    sup.at(15.1, "restart_decision", local_rank=1, decision="give_up", reason="budget spent")
    ranks[0].at(20.0, "round_end", outcome="completed", duration_s=8.0)
    sup.at(20.5, "child_exit", local_rank=0, child_pid=10, exit_code=0, signal=None, runtime_s=20.0)
    sup.at(21.0, "supervisor_end", exit_code=1, reason="rank 1 failed")
    for p in [sup, *ranks.values()]:
        p.close()
    report = build_report(tmp_path / "lat", sacct=False)
    lanes = _lanes(_svg(report.to_text("html")))
    t0 = 1_700_000_000.0
    for rank in ("0", "1"):
        (restart,) = _periods(lanes[rank], "restart")
        assert f"{when(t0 + 6.0)} to {when(t0 + 12.0)}" in restart, restart
        (idle, *_) = _periods(lanes[rank], "idle")  # alive before round 0 started
        assert f"{when(t0 + 0.5)} to {when(t0 + 1.0)}" in idle, idle
    (dead,) = _periods(lanes["1"], "dead")
    assert "signal SIGKILL" in dead and "never replaced" in dead
    assert f"{when(t0 + 15.0)} to {when(t0 + 21.0)}" in dead
    assert not _periods(lanes["0"], "dead")


def test_without_supervisors_every_rank_lives_from_the_start_to_the_end(tmp_path: Path) -> None:
    """Wrapper events only (no child_start/child_exit): each rank alive for the whole run."""
    host = Host("h", 0)
    ranks = {r: Proc(tmp_path / "bare", host, "wrapper", rank=r) for r in (0, 1, 2)}
    for r, p in ranks.items():
        p.at(1.0 + r, "process_start", argv=["train.py"], local_rank=r)
        p.round(0).at(5.0, "round_start", world_size=3, active_world_size=3, active_rank=r, initial_rank=r)
        p.at(30.0, "round_end", outcome="completed", duration_s=25.0)
        p.close()
    report = build_report(tmp_path / "bare", sacct=False)
    assert report.activity.processes == []
    lanes = _lanes(_svg(report.to_text("html")))
    assert sorted(lanes) == ["0", "1", "2"]
    start, end = when(report.summary.start_wall), when(report.summary.end_wall)
    for lane in lanes.values():
        assert _kinds(lane) == {"idle", "training"}
        spans = [t for kind in ("idle", "training") for t in _periods(lane, kind)]
        assert any(f"{start} to " in t for t in spans) and any(t.endswith(f"to {end}") for t in spans)


def test_rank_and_node_filters_draw_only_the_ranks_kept(standard: tuple[Report, str], tmp_path: Path) -> None:
    """``--rank 3`` / ``--node 1``: lanes of the ranks whose events were kept, no others."""
    write_standard_job(tmp_path / JOB)
    by_rank = build_report(tmp_path / JOB, sacct=False, rank=3)
    assert by_rank.activity.ranks == [3]
    lanes = _lanes(_svg(by_rank.to_text("html")))
    assert sorted(lanes) == ["3"] and {"training", "hung"} <= _kinds(lanes["3"])
    by_node = build_report(tmp_path / JOB, sacct=False, node=1)
    assert sorted(_lanes(_svg(by_node.to_text("html")))) == ["2", "3"]
    assert standard[0].activity.ranks is None  # unfiltered: every rank of the job


def test_an_odd_world_size_does_not_stall_the_page(tmp_path: Path) -> None:
    """A round_start claiming 2**31 - 1 ranks: drawn by node, at once, not rank by rank."""
    p = Proc(tmp_path / "odd", Host("h", 0), "wrapper", rank=0)
    p.round(0).at(1.0, "round_start", world_size=2**31 - 1, active_world_size=2, active_rank=0, initial_rank=0)
    p.at(2.0, "round_end", outcome="completed", duration_s=1.0)
    p.close()
    report = build_report(tmp_path / "odd", sacct=False)
    assert report.summary.ranks == 2**31 - 1
    lanes = _lanes(_svg(report.to_text("html")))
    assert sorted(lanes) == ["0"] and lanes["0"].get("data-node") == "0"


def test_thousands_of_rounds_keep_the_page_small(standard: tuple[Report, str]) -> None:
    """5,000 rounds (in-process restarts) on 4 lanes: rounds narrower than a pixel are drawn
    joined, in the colour they spend most time in (restart for the first 2,500: 90 % of each
    round is restart; training after), so each lane holds about as many periods as the
    drawing is pixels wide."""
    report = copy.deepcopy(standard[0])
    t0, span = report.summary.start_wall or 0.0, report.summary.wall_time_s
    step = (span - 2.0) / 5000
    report.timeline = [
        dataclasses.replace(report.timeline[0], round=i, start_wall=t0 + 1.0 + i * step,
                            end_wall=t0 + 1.0 + (i + 0.8) * step,
                            restart_latency_s=(0.9 if i < 2500 else 0.1) * step)
        for i in range(5000)
    ]  # fmt: skip
    svg = _svg(report.to_text("html"))
    lanes = _lanes(svg)
    assert sorted(lanes) == ["0", "1", "2", "3"]
    for lane in lanes.values():
        periods = [r for r in lane.iter("rect") if (r.get("class") or "").startswith("p-")]
        assert len(periods) <= 2 * PLOT_W and {"training", "restart"} <= _kinds(lane)
    assert len(ET.tostring(svg)) < 1_000_000


def test_a_spare_slot_of_several_runs_is_one_lane(standard: tuple[Report, str]) -> None:
    report = copy.deepcopy(standard[0])
    t0 = report.summary.start_wall or 0.0
    report.activity.spares = [
        SpareSpan(0, 2, "s", t0 + 1.0, t0 + 5.0, None),
        SpareSpan(1, 2, "s", t0 + 10.0, t0 + 12.0, 1),
    ]
    spares = [g for g in _svg(report.to_text("html")).iter("g") if g.get("class") == "lane spare"]
    assert [g.get("data-slot") for g in spares] == ["2"] and len(_periods(spares[0], "spare")) == 2


def _requeued_wrapper_job(log_dir: Path) -> None:
    """One node, two Wrapper ranks, twice (run 0 at 0-30 s, preempted with round 1 running, no
    rank ending it; run 1 at 100-130 s, completed): in each run, rank 1 raises in round 0 (at
    10 s into the run) and every rank restarts into round 1 at 11 s."""
    host = Host("h", 0)
    for run, t0 in ((0, 0.0), (1, 100.0)):
        sup = Proc(log_dir, host, "supervisor")
        sup.at(t0, "supervisor_start", nnodes=1, nproc_per_node=2, command="python train.py")
        ranks = {r: Proc(log_dir, host, "wrapper", rank=r) for r in (0, 1)}
        for r, p in ranks.items():
            sup.at(t0 + 1.0, "child_start", local_rank=r, child_pid=50 + r + 10 * run, attempt=0)
            p.round(0).at(t0 + 2.0, "round_start", world_size=2, active_world_size=2, active_rank=r, initial_rank=r)
        ranks[1].at(t0 + 10.0, "fault", fault_kind="exception", origin_rank=1, exc_type="ValueError",
                    message="bad batch 17", traceback=USER_TRACEBACK)  # fmt: skip
        ranks[0].at(t0 + 10.1, "fault", fault_kind="peer", origin_rank=1, message="peer")
        for r, p in ranks.items():
            p.at(t0 + 10.5, "round_end", outcome="restart", duration_s=8.5)
            p.round(1).at(t0 + 11.0, "round_start", world_size=2, active_world_size=2, active_rank=r, initial_rank=r)
        if run == 0:
            sup.at(t0 + 28.5, "job_stop", reason="preempted: requeued", exit_code=143)
        for r, p in ranks.items():
            if run == 1:
                p.at(t0 + 28.0, "round_end", outcome="completed", duration_s=17.0)
            sup.at(t0 + 29.0, "child_exit", local_rank=r, child_pid=50 + r + 10 * run,
                   exit_code=143 if run == 0 else 0, signal=None, runtime_s=28.0)  # fmt: skip
            p.close()
        if run == 0:
            sup.at(t0 + 29.5, "requeue", cause="preemption", count=1)
        sup.at(t0 + 30.0, "supervisor_end", exit_code=0 if run else 143, reason="done" if run else "requeued")
        sup.close()


def test_a_fault_in_the_same_round_number_of_each_run_is_one_mark_each(tmp_path: Path) -> None:
    """Round numbers start again after a requeue: round 0 of run 1 is another round than
    round 0 of run 0, and its fault another fault."""
    _requeued_wrapper_job(tmp_path / "rq")
    report = build_report(tmp_path / "rq", sacct=False)
    assert [(f.rank, f.round) for f in report.activity.faults] == [(1, 0), (1, 0)]
    lanes = _lanes(_svg(report.to_text("html")))
    t0 = 1_700_000_000.0
    tips = [tip for _, tip in _marks(lanes["1"])]
    assert len(tips) == 2 and tips[0].endswith(when(t0 + 10.0)) and tips[1].endswith(when(t0 + 110.0)), tips
    assert _marks(lanes["0"]) == []  # rank 0's PeerLost follows from rank 1's fault, in each run


def test_a_last_round_that_no_rank_ended_trains_until_its_processes_end(tmp_path: Path) -> None:
    """Run 0's round 1 wrote its round_start and nothing else until the preemption stopped
    its processes (29 s): its ranks trained all that time, they were not idle."""
    _requeued_wrapper_job(tmp_path / "rq")
    report = build_report(tmp_path / "rq", sacct=False)
    lanes = _lanes(_svg(report.to_text("html")))
    t0 = 1_700_000_000.0
    for rank in ("0", "1"):
        training = _periods(lanes[rank], "training")
        assert any(f"{when(t0 + 11.0)} to {when(t0 + 29.0)}" in tip for tip in training), training
        idle = _periods(lanes[rank], "idle")
        assert not any(when(t0 + 11.0) in tip for tip in idle), idle


def _restarting_job(log_dir: Path, deaths: int, every_s: float) -> None:
    """One node, one rank run by its supervisor alone (no rounds): its process exits with 1
    ``deaths`` times, ``every_s`` apart, and is replaced 0.3 s after each exit."""
    host = Host("h", 0)
    sup = Proc(log_dir, host, "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=1, command="python train.py")
    sup.at(0.5, "child_start", local_rank=0, child_pid=100, attempt=0)
    t = 0.5
    for i in range(deaths):
        t += every_s
        sup.at(t, "child_exit", local_rank=0, child_pid=100 + i, exit_code=1, signal=None, runtime_s=every_s)
        sup.at(t + 0.1, "restart_decision", local_rank=0, decision="restart", reason="exit 1", budget_left=deaths)
        sup.at(t + 0.3, "child_start", local_rank=0, child_pid=101 + i, attempt=i + 1)
    sup.at(t + every_s, "child_exit", local_rank=0, child_pid=100 + deaths, exit_code=0, signal=None, runtime_s=1.0)
    sup.at(t + every_s + 0.5, "supervisor_end", exit_code=0, reason="done")
    sup.close()


def test_each_process_that_failed_outside_a_round_has_its_mark(tmp_path: Path) -> None:
    """Without rounds, two failed processes of one rank, 30 s apart, are two faults."""
    _restarting_job(tmp_path / "twice", 2, 30.0)
    report = build_report(tmp_path / "twice", sacct=False)
    assert [p.exit_code for p in report.process_restarts] == [1, 1] and not report.timeline
    t0 = 1_700_000_000.0
    tips = [tip for _, tip in _marks(_lanes(_svg(report.to_text("html")))["0"])]
    assert [tip.rsplit(", ", 1)[1] for tip in tips] == [when(t0 + 30.5), when(t0 + 60.5)], tips


def test_thousands_of_process_restarts_keep_the_lane_as_wide_as_the_drawing(tmp_path: Path) -> None:
    """1,500 deaths of one rank's process: more periods than the drawing has pixels. Those
    narrower than a pixel are joined, in the kind they spend most time in (training: each
    process lives 4 s, its replacement starts 0.3 s after), their tooltip counting them."""
    _restarting_job(tmp_path / "many", 1500, 4.0)
    report = build_report(tmp_path / "many", sacct=False)
    assert len(report.process_restarts) == 1500
    page = report.to_text("html")
    lane = _lanes(_svg(page))["0"]
    periods = [r for r in lane.iter("rect") if (r.get("class") or "").startswith("p-")]
    assert len(periods) <= 2 * PLOT_W
    assert any("periods too short to draw one by one (training" in tip and "dead" in tip
               for tip in _periods(lane, "training"))  # fmt: skip
    starts = [float(r.get("data-start") or 0) for r in periods]
    ends = [float(r.get("data-end") or 0) for r in periods]
    t0 = 1_700_000_000.0
    assert min(starts) == pytest.approx(t0 + 0.5) and max(ends) == pytest.approx(t0 + 0.5 + 1501 * 4.0)
    assert len(_marks(lane)) <= PLOT_W


def test_a_job_wide_restart_that_never_started_its_children_is_no_training(tmp_path: Path) -> None:
    """No Wrapper: rank 1 fails at 20 s and the job-wide restart stops both children
    (20.2-21 s), but never starts them again (the job ends at 30 s): the stretch it would
    have begun has no start, and covers no time; the restart lasts until the run's end."""
    host = Host("h", 0)
    sup = Proc(tmp_path / "stuck", host, "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=2, command=["train.py"])
    for lr in (0, 1):
        sup.at(1.0, "child_start", local_rank=lr, child_pid=100 + lr, global_rank=lr, attempt=0)
    sup.at(20.0, "child_exit", local_rank=1, child_pid=101, global_rank=1, exit_code=1, signal=None, runtime_s=19.0)
    cause = {"rank": 1, "node": 0, "signature": "exit code 1"}
    sup.at(20.2, "job_restart", epoch=1, phase="stopping", cause=cause)
    sup.at(21.0, "child_exit", local_rank=0, child_pid=100, global_rank=0, exit_code=None, signal="SIGTERM",
           runtime_s=20.0)  # fmt: skip
    sup.at(21.1, "job_restart", epoch=1, phase="ready", ready=1, nodes=1)
    sup.at(30.0, "supervisor_end", exit_code=1, reason="restart failed")
    sup.close()
    report = build_report(tmp_path / "stuck", sacct=False)
    assert [(t.round, t.start_wall is None) for t in report.timeline] == [(0, False), (1, True)]
    t0 = 1_700_000_000.0
    lane = _lanes(_svg(report.to_text("html")))["0"]
    (training,) = _periods(lane, "training")
    assert f"{when(t0 + 1.0)} to {when(t0 + 20.2)}" in training, training
    (restart,) = _periods(lane, "restart")
    assert f"{when(t0 + 20.2)} to {when(t0 + 21.0)}" in restart, restart


def test_a_rank_filter_keeps_the_runs_of_a_requeued_job_apart(tmp_path: Path) -> None:
    """``--rank 1`` leaves out the supervisors' events, but not the job's runs: rank 1 is not
    drawn training through the 70 s the job waited in the queue, the wait is a requeue band
    up to run 1's supervisor start, and each run's fault is its own mark."""
    _requeued_wrapper_job(tmp_path / "rq")
    report = build_report(tmp_path / "rq", sacct=False, rank=1)
    assert [r.run for r in report.activity.runs] == [0, 1] and not report.activity.processes
    svg = _svg(report.to_text("html"))
    lane = _lanes(svg)["1"]
    t0 = 1_700_000_000.0
    assert len(_marks(lane)) == 2
    for r in lane.iter("rect"):
        if r.get("class") == "p-training":
            assert not float(r.get("data-start") or 0) < t0 + 60.0 < float(r.get("data-end") or 0)
    (band,) = [r for r in svg.iter("rect") if r.get("class") == "requeue-band"]
    assert float(band.get("data-end") or 0) == pytest.approx(t0 + 100.0)
