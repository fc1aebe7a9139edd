"""``--repeat-each N`` of tests/conftest.py: each selected test N times in one session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_repeat_runs_each_test_n_times_in_a_row(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.parametrize("x", [1, 2])
        def test_param(x):
            pass
        def test_plain():
            pass
        """
    )
    result = pytester.runpytest("-v", "--repeat-each", "3")
    result.assert_outcomes(passed=9)
    result.stdout.fnmatch_lines(
        [
            "*test_param?repeat1of3-1? PASSED*",
            "*test_param?repeat1of3-2? PASSED*",
            "*test_param?repeat2of3-1? PASSED*",
            "*test_plain?repeat1of3? PASSED*",
            "*test_plain?repeat2of3? PASSED*",
            "*test_plain?repeat3of3? PASSED*",
        ],
        consecutive=False,
    )


def test_repeat_of_one_changes_nothing(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_a PASSED*"])


def test_repeat_below_one_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest("--repeat-each", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--repeat-each must be at least 1, got 0*"])


REPEAT_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "repeat_tests.py"


def test_repeat_runs_whole_sessions_and_counts_the_failed_rounds(tmp_path: Path) -> None:
    """scripts/test.sh --repeat N: N new pytest sessions; fixtures are built again in each."""
    (tmp_path / "test_flaky.py").write_text(
        "import pathlib, pytest\n"
        "COUNTER = pathlib.Path(__file__).with_name('sessions')\n"
        "@pytest.fixture(scope='session')\n"
        "def session_no():\n"
        "    n = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1\n"
        "    COUNTER.write_text(str(n))\n"
        "    return n\n"
        "def test_fails_in_the_second_session(session_no):\n"
        "    assert session_no != 2\n"
    )
    done = subprocess.run(
        [sys.executable, str(REPEAT_SCRIPT), "3", "-q", "-p", "no:cacheprovider", "test_flaky.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (tmp_path / "sessions").read_text() == "3"  # the session fixture ran once per round
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "repeat: 3 rounds, 1 failed (rounds: 2)"


def test_repeat_needs_at_least_one_round(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPEAT_SCRIPT), "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--repeat must be at least 1, got 0" in done.stderr
