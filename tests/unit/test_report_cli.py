"""nvrx-report as a user runs it: formats, damaged logs, exit codes, SLURM context."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_report_fixtures import JOB, T0, Host, Proc, write_standard_job

from nvrx.report import REPORT_SCHEMA_VERSION, build_report
from nvrx.report.cli import main, parse_since
from nvrx.report.text_doc import Command, Doc
from nvrx.slurm.job_ids import slurm_job_ids
from tests.support import fake_sacct

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "nvrx" / "report" / "report.schema.json"
_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def check_schema(value: Any, schema: dict[str, Any], where: str = "$") -> None:
    """A small validator for the subset of JSON Schema that report.schema.json uses."""
    if "const" in schema:
        assert value == schema["const"], f"{where}: {value!r} != {schema['const']!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(
            isinstance(value, _TYPES[n])
            and not (n in ("integer", "number") and isinstance(value, bool))
            for n in names
        )
        assert ok, f"{where}: {value!r} is not {names}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{where}: missing {key!r}"
        props = schema.get("properties", {})
        for key, sub in value.items():
            if key in props:
                check_schema(sub, props[key], f"{where}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                check_schema(sub, schema["additionalProperties"], f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            check_schema(item, schema["items"], f"{where}[{i}]")


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("base")
    write_standard_job(base / JOB)
    return base / JOB


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_json_output_follows_the_documented_schema(
    job_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(job_dir), "--format", "json", "--no-sacct"]) == 0
    data = json.loads(capsys.readouterr().out)
    schema = json.loads(SCHEMA_PATH.read_text())
    check_schema(data, schema)
    assert data["schema"] == "nvrx-report" and data["schema_version"] == REPORT_SCHEMA_VERSION
    # The schema names every top-level key the report writes, and the other way round.
    assert set(schema["required"]) == set(data)
    assert data["timeline"][0]["first_rank"] == 2
    assert data["summary"]["restarts"] == {
        "in_process": 3,
        "process": 1,
        "requeue": 0,
        "node_loss": 0,
        "job_wide": 0,
    }


def test_schema_validator_rejects_wrong_types() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    with pytest.raises(AssertionError):
        check_schema({"schema": "nvrx-report", "schema_version": 1}, schema)
    with pytest.raises(AssertionError):
        check_schema({"ranks": "4"}, schema["properties"]["summary"])


def test_table_output_has_every_section(job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(job_dir), "--no-sacct", "--width", "0"]) == 0  # cells unwrapped
    out = capsys.readouterr().out
    for heading in (
        "Restart timeline",
        "Failures by signature",
        "Hangs",
        "Process restarts",
        "Suspect nodes",
    ):
        assert f"{heading}\n{'=' * len(heading)}" in out
    assert "rank 2 on node-b (node 1)" in out
    assert "--exclude=node-b\n" in out  # node-a failed once: not enough
    assert "goodput" in out and "ValueError: bad batch 17" in out


def test_markdown_output_is_pasteable(job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(job_dir), "--format", "markdown", "--no-sacct"]) == 0
    out = capsys.readouterr().out
    assert "## Restart timeline" in out
    assert "| round " in out and "|--" in out
    timeline = out.split("## Restart timeline", 1)[1].split("##", 1)[0]
    tables = [b for b in timeline.split("\n\n") if b.startswith("|")]
    assert len(tables) == 2  # rounds, then phase latency
    for table in tables:
        assert (
            len({line.count("|") for line in table.splitlines()}) == 1
        )  # same number of cells per row
    assert "```\nTraceback (most recent call last):" in out


def test_markdown_is_never_wrapped_whatever_the_width(
    job_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/report.md: "Markdown is never wrapped (its tables cannot be)": --width 40, the
    narrowest width there is, leaves the Markdown as it is unlimited, a table row a line."""
    assert main([str(job_dir), "--format", "markdown", "--no-sacct", "--width", "40"]) == 0
    narrow = capsys.readouterr().out
    assert main([str(job_dir), "--format", "markdown", "--no-sacct", "--width", "0"]) == 0
    assert narrow == capsys.readouterr().out
    report = build_report(job_dir, sacct=False)
    assert report.to_text("markdown", width=40) == report.to_text("markdown", width=None)
    # rows longer than the width, each still on one line with all of its cells
    timeline = narrow.split("## Restart timeline", 1)[1].split("\n\n")[1].splitlines()
    assert timeline[0].startswith("| round ") and timeline[1].startswith("|--")
    assert all(len(row) > 40 for row in timeline)
    assert len({row.count("|") for row in timeline}) == 1
    assert len(timeline) == 2 + 4  # header, rule, one line for each of the 4 rounds
    # a cell wider than the width stays whole, beside its row's other cells
    row_0 = next(row for row in timeline if row.startswith("| 0 "))
    assert "| ValueError at train.py:12 in step |" in row_0
    assert "| rank 2 on node-b (node 1) |" in row_0


#: Text of events that Markdown would read as HTML, emphasis, a link, a heading, a list, code.
_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/u/my_*model*.py", line 3, in __init__\n'
    "    raise TypeError(\"expected <class 'int'>, got <class 'str'>\")\n"
    "TypeError: expected <class 'int'>, got <class 'str'>\n"
)
_MESSAGE = "see [the docs](http://x.y)\n```\n# not a heading\n```"
_REASON = "TypeError: expected <class 'int'>, got <class 'str'>\n\n# 1. [retry](http://x)\n    *args"


def _job_with_markdown_in_its_text(log_dir: Path) -> None:
    """Two ranks on two hosts fail in round 0: rank 0 with ``_TRACEBACK``, rank 1 with
    ``_MESSAGE`` and no traceback; the job stops for ``_REASON``."""
    hosts = {0: Host("dgx_a100_01", 0), 1: Host("node-b", 1)}
    sup = {n: Proc(log_dir, h, "supervisor") for n, h in hosts.items()}
    for s in sup.values():
        s.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=1, command="python train.py")
    ranks = {r: Proc(log_dir, hosts[r], "wrapper", rank=r) for r in range(2)}
    for r, p in ranks.items():
        p.at(1.0, "process_start", argv=["train.py"], local_rank=0)
        p.round(0).at(2.0, "round_start", world_size=2, active_world_size=2, active_rank=r, initial_rank=r)
    ranks[0].at(5.0, "fault", fault_kind="exception", origin_rank=0, exc_type="TypeError", traceback=_TRACEBACK)
    ranks[1].at(5.1, "fault", fault_kind="exception", origin_rank=1, exc_type="ValueError", message=_MESSAGE)
    for p in ranks.values():
        p.at(6.0, "round_end", outcome="failed", duration_s=4.0)
    for s in sup.values():
        s.at(7.0, "job_stop", reason=_REASON, exit_code=1)
        s.at(7.1, "supervisor_end", exit_code=1, reason=_REASON)


def _outside_code_blocks(markdown: str) -> str:
    """``markdown`` without its fenced code blocks (a block ends at a fence at least as long
    as the one that opened it, as CommonMark reads it)."""
    kept, fence = [], ""
    for line in markdown.splitlines():
        run = len(line) - len(line.lstrip("`"))
        if not fence and run >= 3:
            fence = "`" * run
        elif fence and line.strip() and line.strip("`") == "" and run >= len(fence):
            fence = ""
        elif not fence:
            kept.append(line)
    return "\n".join(kept)


def test_markdown_shows_the_events_text_as_it_is_not_as_markdown(tmp_path: Path) -> None:
    """Before: the events' text went into the Markdown as it was, and a viewer (GitHub,
    GitLab) made HTML tags of ``<class 'int'>``, bold of ``__init__``, emphasis of
    ``*model*``, a link of ``[retry](http://x)``, a heading of a reason's ``# 1.`` line; a
    message's own ``` ended its code block. Now what Markdown would read is escaped, and a
    code block's fence is longer than any in it; the text report is as it was."""
    _job_with_markdown_in_its_text(tmp_path)
    report = build_report(tmp_path, sacct=False)
    markdown = report.to_text("markdown")
    prose = _outside_code_blocks(markdown)
    signature = r"TypeError at my\_\*model\*.py:3 in \_\_init\_\_"
    assert f"| {signature} | exception |" in prose  # a table's cell
    assert f"**\\[{signature}\\]**" in prose  # a block's title
    assert f"one fault of its own ({signature}): not enough to exclude" in prose  # a paragraph
    for raw in ("__init__", "*model*", "<class", "[retry", "](http", "\n# "):
        assert re.search(r"(?<!\\)" + re.escape(raw), prose) is None, raw  # not escaped
    outcome = next(part for part in markdown.split("\n\n") if part.startswith("outcome:"))
    assert outcome == (  # its blank line left out, which would end the paragraph there
        "outcome: FAILED: failed (exit code 1) (TypeError: expected \\<class 'int'>, got "
        "\\<class 'str'>\\\n\\# 1. \\[retry\\](http\\://x)\\\n\u00a0\u00a0\u00a0\u00a0\\*args); 2 ranks on "
        "2 node(s), "
        "7.100 s wall, goodput 0.0 %"
    )
    assert f"**\\[ValueError\\]**\n\n````\n{_MESSAGE}\n````\n" in markdown
    assert f"```\n{_TRACEBACK.rstrip()}\n```" in markdown  # verbatim in its code block
    assert "| dgx_a100_01 |" in prose  # inside a word, "_" makes no emphasis: left as it is
    text = report.to_text("table", width=None)
    assert "TypeError at my_*model*.py:3 in __init__" in text and "\\" not in text
    assert f"outcome: FAILED: failed (exit code 1) ({_REASON}); 2 ranks" in text


def test_markdown_headings_commands_and_lines_say_their_text_as_it_is() -> None:
    """A heading's ``#`` would end it; a command's ``` would end its code block; a line
    that starts with ``-``, ``1.``, ``2)``, ``>`` or ``===`` would be a list, a quote or make
    the line above a heading; a ``|`` may make a table. The report's own Markdown (heading,
    code block) stays."""
    doc = Doc(markdown=True)
    doc.heading("job 7 #")
    doc.lines(["run:", Command("echo ``` done")])
    doc.text("why:\n- a | b\n1. c\n2) d\n> e\n===")
    assert doc.render() == (
        "## job 7 \\#\n\nrun:\n\n````\necho ``` done\n````\n\n"
        "why:\\\n\\- a \\| b\\\n1\\. c\\\n2\\) d\\\n\\> e\\\n\\===\n"
    )


def test_a_markdown_line_of_a_colon_and_dashes_makes_no_table_of_the_line_above() -> None:
    """GFM reads a line like ``:--`` under a paragraph's line as a table's delimiter row, the
    line above as the table's header and the lines below as its rows: a reason's line that
    starts with a colon has it escaped, and the paragraph stays one."""
    doc = Doc(markdown=True)
    doc.text("why:\nstore down\n:--\n  :-: \nstill down: for 3 s")
    assert doc.render() == (
        "why:\\\nstore down\\\n\\:--\\\n\u00a0\u00a0\\:-: \\\nstill down: for 3 s\n"
    )


def test_a_markdown_line_indented_with_tabs_keeps_its_indent_and_starts_no_code_block() -> None:
    """A viewer strips a paragraph line's leading tabs as it strips spaces, and a first line
    indented by a tab is an indented code block, which shows the escapes and the hard line
    break's backslash: a tab of the indent becomes no-break spaces to the next multiple of 8
    columns, as a terminal shows the text report's."""
    nbsp = "\u00a0"
    doc = Doc(markdown=True)
    doc.text("\tat <module>\nwhy:\n\tstore down\n \t x")
    assert doc.render() == (
        f"{nbsp * 8}at \\<module>\\\nwhy:\\\n{nbsp * 8}store down\\\n{nbsp * 9}x\n"
    )


def test_a_web_address_in_markdown_is_text_whose_escapes_do_not_show() -> None:
    """GFM makes a link of ``http://...`` or ``www....`` from the raw text up to a space, its
    backslashes kept: a viewer would show ``\\_\\_init\\_\\_`` in it and link there. Its
    ``://`` and ``www.`` are escaped, so it stays text and its escapes do not show."""
    doc = Doc(markdown=True)
    doc.text("fetch HTTPS://x.y/__init__.py failed; see www.x.y/*a*")
    doc.table([["ftp://x.y/~u/"]], ["where"])
    assert doc.render() == (
        "fetch HTTPS\\://x.y/\\_\\_init\\_\\_.py failed; see www\\.x.y/\\*a\\*\n\n"
        "| where           |\n|-----------------|\n| ftp\\://x.y/\\~u/ |\n"
    )


#: An exception's message with what GitHub reads in text once the Markdown is parsed.
_GITHUB_MESSAGE = (
    "store of @alice-b down, see #123 and nvidia/nvrx#45 :fire: cost $x$ and $$y$$ at 12:30:45, "
    "mail ops@x.io or ssh u@node-a"
)


def _job_that_fails_with(log_dir: Path, message: str) -> None:
    """One rank raises ``message``; its supervisor stops the job for it."""
    host = Host("node-a", 0)
    sup, rank = Proc(log_dir, host, "supervisor"), Proc(log_dir, host, "wrapper", rank=0)
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=1, command="python train.py")
    rank.at(1.0, "process_start", argv=["train.py"], local_rank=0)
    rank.round(0).at(2.0, "round_start", world_size=1, active_world_size=1, active_rank=0, initial_rank=0)
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 3, in step\n'
        f"    raise RuntimeError({message!r})\n"
        f"RuntimeError: {message}\n"
    )
    rank.at(5.0, "fault", fault_kind="exception", origin_rank=0, exc_type="RuntimeError",
            message=message, traceback=traceback)
    rank.at(6.0, "round_end", outcome="failed", duration_s=4.0)
    sup.at(7.0, "job_stop", reason=f"RuntimeError: {message}", exit_code=1)
    sup.at(7.1, "supervisor_end", exit_code=1, reason=f"RuntimeError: {message}")
    for proc in (sup, rank):
        proc.close()


def test_markdown_makes_no_mention_issue_link_emoji_or_math_on_github(tmp_path: Path) -> None:
    """GitHub reads ``@name`` (a mention, which notifies that user), ``#123`` and
    ``owner/repo#45`` (links to issues), ``:fire:`` (an emoji) and ``$x$`` (math) in a
    Markdown text after parsing it, so a backslash would not stop it: a word joiner (U+2060,
    invisible) after the ``@``, ``#`` or ``:`` and before each ``$`` (also escaped, for viewers
    that read math while parsing) breaks each up. A mail address and ``user@host`` mention no
    one and are left whole, to be copied from the page; so is a clock's ``12:30:45``, and the
    code blocks, where GitHub reads none of these."""
    _job_that_fails_with(tmp_path, _GITHUB_MESSAGE)
    report = build_report(tmp_path, sacct=False)
    markdown = report.to_text("markdown")
    j = "\u2060"
    shown = (
        f"store of @{j}alice-b down, see #{j}123 and nvidia/nvrx#{j}45 :{j}fire: cost "
        f"{j}\\$x{j}\\$ and {j}\\${j}\\$y{j}\\${j}\\$ at 12:30:45, mail ops@x.io or ssh u@node-a"
    )
    assert markdown.splitlines()[2] == (
        f"outcome: FAILED: failed (exit code 1) (RuntimeError: {shown}); 1 ranks on 1 node(s), "
        "7.100 s wall, goodput 0.0 %"
    )
    assert f"| reason                   | RuntimeError: {shown} |" in markdown
    assert f"    raise RuntimeError({_GITHUB_MESSAGE!r})\n" in markdown  # verbatim in its code block
    assert f"(RuntimeError: {_GITHUB_MESSAGE}); 1 ranks" in report.to_text("table", width=None)


def test_base_dir_with_job_option_and_output_file(job_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.md"
    assert (
        main(
            [
                str(job_dir.parent),
                "--job",
                JOB,
                "--no-sacct",
                "--format",
                "markdown",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert out.read_text().startswith(f"## nvrx report: job {JOB}")


def test_unknown_job_in_base_dir_exits_2(job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(job_dir.parent), "--job", "999", "--no-sacct"]) == 2
    err = capsys.readouterr().err
    assert "999" in err and JOB in err


def test_missing_dir_exits_2_with_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "nope"), "--no-sacct"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_empty_dir_exits_2_with_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "--no-sacct"]) == 2
    assert "empty" in capsys.readouterr().err


def test_dir_of_non_event_files_exits_2_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "model.pt").write_bytes(b"\x00\x01")
    assert main([str(tmp_path), "--no-sacct"]) == 2
    err = capsys.readouterr().err
    assert "no event files" in err and "2 other file(s)" in err


def test_event_files_with_only_garbage_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "wrapper-n0-p1-x.jsonl").write_bytes(b"not json\n\xff\xfe\n")
    assert main([str(tmp_path), "--no-sacct"]) == 2
    assert "malformed line" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["table", "json", "markdown", "html"])
def test_the_report_writes_nothing_into_the_log_directory(tmp_path: Path, fmt: str) -> None:
    logs = tmp_path / "logs" / JOB
    write_standard_job(logs)
    (logs / "slurm-1234.out").write_text("Traceback (most recent call last):\nValueError: x\n")

    def state() -> dict[str, tuple[str, int, int]]:
        """Every file and folder below tmp_path: its bytes' digest, mtime and mode."""
        seen = {}
        for path in tmp_path.rglob("*"):
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
            seen[str(path.relative_to(tmp_path))] = (digest, path.stat().st_mtime_ns, path.stat().st_mode)
        return seen

    before = state()
    out = tmp_path / "elsewhere" / f"report.{fmt}"
    out.parent.mkdir()
    assert main([str(logs), "--format", fmt, "--no-sacct", "-o", str(out)]) == 0
    assert main([str(logs.parent), "--format", fmt, "--no-sacct", "-o", str(out)]) == 0  # the base
    after = state()
    del after["elsewhere"], after[f"elsewhere/report.{fmt}"]
    assert after == before and out.stat().st_size > 0  # nothing new, changed or touched


def test_damaged_logs_still_report_and_say_what_was_skipped(tmp_path: Path) -> None:
    write_standard_job(tmp_path)
    victim = sorted(tmp_path.glob("wrapper-*.jsonl"))[0]
    with open(victim, "ab") as fh:
        fh.write(b'{"v":1,"kind":"round_start","wall":1.0,"rank":0,"ro')  # torn last line
    garbage = tmp_path / "wrapper-n9-p9-garbage.jsonl"
    garbage.write_bytes(
        b'garbage line\n{"v":2,"kind":"gpu_thermal","wall":1700000001.0,"node":0}\n[1,2]\n'
    )
    (tmp_path / "README").write_text("not events")
    before = _digest(tmp_path)
    report = build_report(tmp_path, sacct=False)
    assert _digest(tmp_path) == before  # the report never modifies the logs
    reasons = {(Path(s["path"]).name, s["reason"]) for s in report.reading.skipped}
    assert (victim.name, "torn last line") in reasons
    assert (garbage.name, "malformed line") in reasons
    assert (garbage.name, "not an event object") in reasons
    assert report.reading.skipped_count == 3
    assert report.reading.unknown_kinds == {"gpu_thermal": 1}
    assert any("gpu_thermal" in n for n in report.reading.notes)
    assert report.timeline[0].first_rank == 2  # the story is intact
    text = report.to_text("table", width=None)
    assert "torn last line" in text


def test_interleaved_lines_of_two_writers_are_both_read(tmp_path: Path) -> None:
    h = Host("h", 0)
    p = Proc(tmp_path, h, "wrapper", rank=0).round(0)
    first = p.at(1.0, "round_start", world_size=1)
    second = p.at(2.0, "round_end", outcome="completed")
    p.close()
    merged = tmp_path / "wrapper-n0-p2-merged.jsonl"
    merged.write_text(json.dumps(first) + json.dumps(second) + "\n")
    report = build_report(tmp_path, sacct=False)
    assert report.reading.events == 4 and report.reading.skipped_count == 0


def test_sacct_failure_is_reported_not_fatal(
    job_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    script = fake / "sacct"
    script.write_text(
        "#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    report = build_report(job_dir)
    assert not report.slurm.available
    assert "accounting storage is disabled" in report.slurm.error
    assert "sacct failed" in report.to_text("table")


def test_sacct_missing_is_reported(
    job_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    report = build_report(job_dir)
    assert "sacct not found" in report.slurm.error


def test_sacct_records_are_merged_into_the_summary(
    job_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    rows = [
        f"{JOB}|{JOB}|train|NODE_FAIL|0:0|00:01:00|node-[a-b]|2024-01-01T00:00:00|2024-01-01T00:01:00",
        f"{JOB}|{JOB}|train|COMPLETED|0:0|00:01:03|node-[a-b]|2024-01-01T00:02:00|2024-01-01T00:03:03",
        f"{JOB}.batch|{JOB}.batch|batch|COMPLETED|0:0|00:01:03|node-a|2024-01-01T00:02:00|2024-01-01T00:03:03",
        f"{JOB}.0|{JOB}.0|nvrx-supervise|COMPLETED|0:0|00:01:02|node-[a-b]|2024-01-01T00:02:01|2024-01-01T00:03:03",
    ]
    argv_log = tmp_path / "argv"
    script = fake / "sacct"
    script.write_text(
        '#!/bin/sh\necho "$@" > ' + str(argv_log) + "\ncat <<'EOF'\n" + "\n".join(rows) + "\nEOF\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    report = build_report(job_dir)
    argv = argv_log.read_text()
    assert (
        "--parsable2" in argv
        and "-D" in argv
        and "JobID,JobIDRaw,JobName,State,ExitCode,Elapsed,NodeList,Start,End" in argv
    )
    assert report.slurm.available
    assert [r.state for r in report.slurm.job] == ["NODE_FAIL", "COMPLETED"]
    assert [r.job_id for r in report.slurm.steps] == [f"{JOB}.batch", f"{JOB}.0"]
    assert report.summary.restarts.requeue == 1  # one job record per run
    assert report.summary.outcome.startswith("COMPLETED (sacct")
    assert "NODE_FAIL" in report.to_text("table")


def test_slurm_and_submitit_output_show_failures_no_event_saw(
    job_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / f"slurm-{JOB}.out"
    out.write_text(
        "starting\n"
        # node 0 printed it, but no process of node 0 ended unexplained: not a failure
        "0: Traceback (most recent call last):\n"
        '0:   File "/home/u/train.py", line 3, in <module>\n'
        "0:     import missing_module\n"
        "0: ModuleNotFoundError: No module named 'missing_module'\n"
        # the same failure as an event: must not be listed twice
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 30, in train\n'
        "    step(batch)\n"
        '  File "/home/u/train.py", line 12, in step\n'
        "    raise ValueError('bad batch 17')\n"
        "ValueError: bad batch 17\n"
        "srun: error: node-b: task 1: Segmentation fault\n"
    )
    submitit = tmp_path / "submitit"
    submitit.mkdir()
    (submitit / f"{JOB}_0_log.err").write_text(
        f"slurmstepd: error: *** JOB {JOB} ON node-a CANCELLED AT 2024-01-01T00:03:00 DUE TO TIME LIMIT ***\n"
    )
    report = build_report(job_dir, sacct=False, slurm_output=[out], submitit_folders=[submitit])
    found = {f.signature: f for f in report.log_findings}
    assert set(found) == {"signal SIGSEGV", "slurm: time limit"}
    # srun's task 1 is node 1's supervisor (one task per node)
    assert (found["signal SIGSEGV"].nodes, found["signal SIGSEGV"].hosts) == ([1], ["node-b"])
    sources = {f.signature: f.source for f in report.failures}
    assert sources["signal SIGSEGV"] == "slurm_output"
    assert sources["ValueError at train.py:12 in step"] == "events"
    assert sorted(report.slurm.output_files) == sorted(
        [str(out.resolve()), str((submitit / f"{JOB}_0_log.err").resolve())]
    )
    assert any("also appear in the events" in n for n in report.reading.notes)
    assert any("1 traceback(s)/stack dump(s)" in n for n in report.reading.notes)


def test_missing_slurm_output_file_is_a_note(job_dir: Path, tmp_path: Path) -> None:
    report = build_report(job_dir, sacct=False, slurm_output=[tmp_path / "gone.out"])
    assert any("gone.out" in n and "not found" in n for n in report.reading.notes)


def test_missing_submitit_folder_is_a_note_as_a_missing_output_file_is(
    job_dir: Path, tmp_path: Path
) -> None:
    """Before: a mistyped --submitit-folder was passed over without a word."""
    (tmp_path / "a file").write_text("")
    report = build_report(
        job_dir, sacct=False, submitit_folders=[tmp_path / "gone", tmp_path / "a file"]
    )
    for name in ("gone", "a file"):
        said = f"submitit folder {str(tmp_path / name)!r} not found; skipped"
        assert said in report.reading.notes, report.reading.notes


def test_parse_since() -> None:
    assert parse_since("1700000000.5") == 1700000000.5
    assert parse_since("2023-11-14T22:13:20") == 1700000000.0
    assert parse_since("2023-11-14T23:13:20+01:00") == 1700000000.0
    assert parse_since("30m", now=1000.0 + 1800) == 1000.0
    assert parse_since("2h", now=7200.0) == 0.0
    with pytest.raises(Exception, match="--since 'yesterday'"):
        parse_since("yesterday")


def test_console_script_runs_without_torch(job_dir: Path) -> None:
    code = (
        "import sys; from nvrx.report.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'report imported torch'; sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(job_dir), "--no-sacct", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["job"] == JOB


@pytest.mark.parametrize(
    "filters", [["--since", "2099-01-01"], ["--node", "1", "--since", "2099-01-01"], ["--rank", "2", "--since", "2099-01-01"]]
)
def test_filters_that_leave_out_the_end_say_the_outcome_is_not_known(
    job_dir: Path, capsys: pytest.CaptureFixture[str], filters: list[str]
) -> None:
    """Before: 'NOT FINISHED: unknown (... still running ...)' of a job that completed."""
    assert main([str(job_dir), "--no-sacct", "--width", "0", *filters]) == 0
    text = capsys.readouterr().out
    outcome = next(line for line in text.splitlines() if line.startswith("outcome: "))
    assert outcome.startswith("outcome: not known under the filters (the --rank/--node/--since "), outcome
    assert "NOT FINISHED" not in text and "still running" not in text
    assert main([str(job_dir), "--no-sacct", "--format", "html", *filters]) == 0
    assert 'class="outcome outcome-unknown"' in capsys.readouterr().out


def test_filters_that_keep_the_end_still_tell_the_outcome(
    job_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(job_dir), "--no-sacct", "--format", "json", "--node", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["outcome"] == "completed"


@pytest.mark.parametrize("newest", [JOB, "100"])
def test_without_job_the_newest_job_of_the_base_is_reported_and_the_report_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], newest: str
) -> None:
    write_standard_job(tmp_path / JOB)
    other = Proc(tmp_path / "100", Host("node-a", 0), "supervisor", job="100")
    other.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=1, command="python t.py")
    other.close()
    for job in (JOB, "100"):  # file times decide, not names: either may be the newer
        stamp = T0 + (3600 if job == newest else 0)
        for path in (tmp_path / job).rglob("*.jsonl"):
            os.utime(path, (stamp, stamp))
    assert main([str(tmp_path), "--no-sacct", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["job"] == newest
    older = "100" if newest == JOB else JOB
    said = f"reporting the newest, {newest} (others: {older}; pass --job)"
    assert any(said in note for note in report["reading"]["notes"]), report["reading"]


def test_a_since_that_keeps_events_of_an_unfinished_job_says_it_is_not_finished(
    job_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The end events are the latest: a ``--since`` that keeps any event keeps them too, so
    without them the job is unfinished, not of an outcome the filter hid."""
    running = tmp_path / "running" / job_dir.name
    shutil.copytree(job_dir, running)
    ends = ('"kind":"supervisor_end"', '"kind": "supervisor_end"', '"kind":"job_stop"',
            '"kind": "job_stop"', '"kind":"wrapper_end"', '"kind": "wrapper_end"')  # fmt: skip
    for path in running.rglob("*.jsonl"):
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(line for line in lines if not any(end in line for end in ends)))
    assert main([str(running), "--no-sacct", "--width", "0", "--since", "1000"]) == 0
    outcome = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("outcome: "))
    assert outcome.startswith("outcome: NOT FINISHED"), outcome
    assert "not known under the filters" not in outcome, outcome


def _fake_sacct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *rows: str) -> Path:
    """An ``sacct`` first on PATH that prints ``rows``; the file it writes its arguments to."""
    fake = tmp_path / "bin"
    fake.mkdir()
    argv_log = tmp_path / "argv"
    lines = "".join(f'echo "{row}"\n' for row in rows)
    (fake / "sacct").write_text(f'#!/bin/sh\necho "$@" > {argv_log}\n{lines}')
    (fake / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return argv_log


def _supervised_in_slurm_job(logs: Path, slurm_job: str) -> None:
    """A one-node job whose supervisor ran in SLURM job ``slurm_job``, its rank with it."""
    sup = Proc(logs, Host("node-a", 0), "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=1, command="python train.py",
           store="node-a:29500", slurm_job_id=slurm_job)  # fmt: skip
    rank = Proc(logs, Host("node-a", 0), "wrapper", rank=0)
    rank.at(1.0, "process_start", argv=["train.py"], local_rank=0)
    sup.at(5.0, "supervisor_end", exit_code=0, reason="completed")
    sup.close()
    rank.close()


_ROW_4242 = "4242|4242|train|COMPLETED|0:0|00:00:05|node-a|2024-01-01T00:00:00|2024-01-01T00:00:05"


def test_sacct_is_asked_about_the_slurm_job_the_supervisors_ran_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With NVRX_JOB_ID set the events' job is not SLURM's: sacct is asked about the SLURM
    job id the supervisors' start names, and its rows are that job's."""
    logs = tmp_path / "logs"
    _supervised_in_slurm_job(logs, "4242")
    argv_log = _fake_sacct(tmp_path, monkeypatch, _ROW_4242)
    report = build_report(logs)
    assert report.summary.job == JOB != "4242"
    assert "-j 4242 " in argv_log.read_text()
    assert [r.state for r in report.slurm.job] == ["COMPLETED"]


def _record(job_id: str, raw: str, state: str) -> dict[str, str]:
    return {"JobID": job_id, "JobIDRaw": raw, "JobName": "train", "State": state, "ExitCode": "0:0"}


# As sacct -D lists a job array asked about by its id, 4242: element 0 ran as SLURM job 4243,
# element 1 (requeued once) kept the array's id, as the element started last does.
_ARRAY_RECORDS = (
    _record("4242_0", "4243", "FAILED"),
    _record("4242_0.batch", "4243.batch", "FAILED"),
    _record("4242_1", "4242", "NODE_FAIL"),
    _record("4242_1", "4242", "COMPLETED"),
    _record("4242_1.batch", "4242.batch", "COMPLETED"),
    _record("4242_1.0", "4242.0", "COMPLETED"),
)
# A heterogeneous job 4250: its SLURM_JOB_ID is its first component's id.
_HET_RECORDS = (
    _record("4250+0", "4250", "COMPLETED"),
    _record("4250+0.batch", "4250.batch", "COMPLETED"),
    _record("4250+1", "4251", "COMPLETED"),
    _record("4250+1.0", "4251.0", "COMPLETED"),
)


@pytest.mark.parametrize(
    ("slurm_job", "records", "runs", "steps"),
    [
        ("4243", _ARRAY_RECORDS, [("4242_0", "FAILED")], ["4242_0.batch"]),
        ("4242", _ARRAY_RECORDS, [("4242_1", "NODE_FAIL"), ("4242_1", "COMPLETED")],
         ["4242_1.batch", "4242_1.0"]),
        ("4250", _HET_RECORDS, [("4250+0", "COMPLETED")], ["4250+0.batch"]),
    ],
    ids=["array-element", "array-element-with-the-arrays-id", "heterogeneous"],
)  # fmt: skip
def test_sacct_records_of_an_array_element_or_het_job_are_found_by_its_slurm_job_id(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    slurm_job: str,
    records: tuple[dict[str, str], ...],
    runs: list[tuple[str, str]],
    steps: list[str],
) -> None:
    """SLURM_JOB_ID, the id the supervisors record, is sacct's JobIDRaw: an array element's
    JobID is <array id>_<index>, a heterogeneous job's <id>+<offset>. The element's records
    (or the first component's) are the job's, shown by their JobID; the others' are not."""
    logs = tmp_path / "logs"
    _supervised_in_slurm_job(logs, slurm_job)
    argv_log = fake_sacct.install(tmp_path / "bin", records)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    report = build_report(logs)
    assert f"-j {slurm_job} " in argv_log.read_text()
    assert report.slurm.available, report.slurm.error
    assert [(r.job_id, r.state) for r in report.slurm.job] == runs
    assert [r.job_id for r in report.slurm.steps] == steps
    assert report.summary.restarts.requeue == len(runs) - 1
    assert report.summary.outcome.startswith(f"{runs[-1][1]} (sacct")


@pytest.mark.parametrize(
    "filters", [{"rank": 0}, {"since": T0 + 1.0}], ids=["rank", "since"]
)
def test_filters_that_leave_out_the_supervisor_start_still_ask_sacct_about_its_slurm_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, filters: dict[str, Any]
) -> None:
    """--rank and --since narrow the events shown, not the job: the SLURM job the
    supervisors ran in is taken from their starts whatever the filters keep, as the job's runs
    are, and sacct is asked about it, not about the events' job."""
    logs = tmp_path / "logs"
    _supervised_in_slurm_job(logs, "4242")
    argv_log = _fake_sacct(tmp_path, monkeypatch, _ROW_4242)
    report = build_report(logs, **filters)
    assert "-j 4242 " in argv_log.read_text()
    assert [r.state for r in report.slurm.job] == ["COMPLETED"]


def test_a_job_resubmitted_under_one_nvrx_job_id_asks_sacct_about_its_last_slurm_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Submitted again under the same NVRX_JOB_ID, a job's runs are SLURM jobs of their own
    (a requeue keeps its id): sacct is asked about the last run's, whose end is the outcome's,
    never about the events' job, and a note names the others."""
    logs = tmp_path / "logs"
    host = Host("node-a", 0)
    sup = Proc(logs, host, "supervisor")
    for t, slurm_job in ((0.0, "4300"), (100.0, "4242")):  # ids need not grow with time
        sup.at(t, "supervisor_start", nnodes=1, nproc_per_node=1, command="python train.py",
               store="node-a:29500", slurm_job_id=slurm_job)  # fmt: skip
        sup.at(t + 5.0, "supervisor_end", exit_code=0, reason="completed")
    sup.close()
    argv_log = _fake_sacct(tmp_path, monkeypatch, _ROW_4242)
    report = build_report(logs)
    assert "-j 4242 " in argv_log.read_text()
    assert [r.state for r in report.slurm.job] == ["COMPLETED"]
    assert (
        "the supervisors ran in 2 SLURM jobs (4300, 4242, in the order their runs started): "
        "sacct was asked about the last, 4242" in report.reading.notes
    )


def test_the_output_files_of_the_slurm_jobs_the_supervisors_ran_in_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvrx's templates name their output after SLURM's job id (nvrx-%j.out), which is not
    the events' job when NVRX_JOB_ID is set: the report looks for the output files of every
    SLURM job its supervisors ran in, and of the events' job."""
    logs = tmp_path / "logs"
    host = Host("node-a", 0)
    sup = Proc(logs, host, "supervisor")
    for t, slurm_job in ((0.0, "4300"), (100.0, "4242")):
        sup.at(t, "supervisor_start", nnodes=1, nproc_per_node=1, command="python train.py",
               store="node-a:29500", slurm_job_id=slurm_job)  # fmt: skip
        sup.at(t + 5.0, "supervisor_end", exit_code=0, reason="completed")
    sup.close()
    outputs = [tmp_path / name for name in ("nvrx-4300.out", "slurm-4242.out", f"slurm-{JOB}.out")]
    for path in outputs:
        path.write_text("starting\n")
    monkeypatch.chdir(tmp_path)
    report = build_report(logs, sacct=False)
    assert sorted(report.slurm.output_files) == sorted(str(p.resolve()) for p in outputs)


@pytest.mark.parametrize(
    ("slurm_job", "index"), [("4245", "3"), ("4242", "0")],
    ids=["array-element", "array-element-with-the-arrays-id"],
)  # fmt: skip
def test_an_array_elements_own_output_files_are_read_not_the_other_elements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm_job: str, index: str
) -> None:
    """An element of job array 4242 runs as SLURM job ``slurm_job`` (one element's own id is
    the array's); SLURM names its default output slurm-%A_%a.out, submitit its logs
    %A_%a_%t_log.out, and nvrx's templates nvrx-%j.out (its own id). Its supervisor records
    the array's id and its index beside SLURM_JOB_ID, so the report reads its files, and not
    those of element 7. Before: none of its slurm-4242_N.out was found for element 3, and for
    element 0, slurm-4242_*.out and 4242_*_log.out took element 7's files as its own."""
    env = {"SLURM_JOB_ID": slurm_job, "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": index}
    logs = tmp_path / "logs"
    sup = Proc(logs, Host("node-a", 0), "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=1, command="python train.py",
           store="node-a:29500", **slurm_job_ids(env))  # fmt: skip
    sup.at(5.0, "supervisor_end", exit_code=0, reason="completed")
    sup.close()
    folder = tmp_path / "submitit"
    folder.mkdir()
    own = [tmp_path / f"slurm-4242_{index}.out", tmp_path / f"nvrx-{slurm_job}.out",
           folder / f"4242_{index}_0_log.out", folder / f"4242_{index}_0_log.err"]  # fmt: skip
    others = [tmp_path / "slurm-4242_7.out", folder / "4242_7_0_log.out"]
    for path in own + others:
        path.write_text("starting\n")
    monkeypatch.chdir(tmp_path)
    report = build_report(logs, sacct=False, submitit_folders=[folder])
    assert sorted(report.slurm.output_files) == sorted(str(p.resolve()) for p in own)
