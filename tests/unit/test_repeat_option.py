"""``--repeat N`` of tests/conftest.py: the flake-hunting option of ``scripts/test.sh``."""

from __future__ import annotations

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
    result = pytester.runpytest("-v", "--repeat", "3")
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
    result = pytester.runpytest("--repeat", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--repeat must be at least 1, got 0*"])
