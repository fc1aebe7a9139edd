"""How the report splits a job's rank files among worker processes: by bytes, not by count.

A job of a few huge files (few ranks, long runs) is read in worker processes
too, and the files are dealt so that each piece of work holds about as many
bytes; whichever way they are dealt, the report is the one read in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nvrx.report import build, build_report
from tests.support.bench_module import load_bench


def test_chunks_hold_about_as_many_bytes_and_every_file_once() -> None:
    sizes = {Path(f"f{i}"): size for i, size in enumerate([90, 10, 10, 10, 40, 40, 5, 5])}
    files = list(sizes)
    chunks = build._chunks(files, sizes, 3)
    assert sorted(p for chunk in chunks for p in chunk) == sorted(files)
    # The biggest file alone, the others shared evenly (dealt by count: 105, 55 and 50).
    assert sorted(sum(sizes[p] for p in chunk) for chunk in chunks) == [60, 60, 90]
    for chunk in chunks:  # each in the files' own order
        assert chunk == sorted(chunk, key=files.index)


def _generator() -> Any:
    return load_bench("gen_synthetic_logs", "gen_synthetic_logs")


@pytest.mark.timeout(120)
def test_a_few_big_files_are_read_by_workers_as_one_process_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_dir = tmp_path / "job"
    _generator().generate(job_dir, ranks=8, rounds=6, ranks_per_node=4, job="4242", seed=2)
    alone = build_report(job_dir, sacct=False, workers=1).to_dict()
    seen: list[int] = []
    chunks = build._chunks
    monkeypatch.setattr(build, "_chunks", lambda *a: seen.append(a[2]) or chunks(*a))
    monkeypatch.setattr(build, "PARALLEL_MIN_BYTES", 1)  # these few files count as big
    workers = build_report(job_dir, sacct=False, workers=2).to_dict()
    assert seen == [8]  # in worker processes: 2 x CHUNKS_PER_WORKER pieces
    alone.pop("generated_at"), workers.pop("generated_at")
    assert alone == workers
