"""``--help`` on a narrow terminal (``nvrx.help_format``): every program's text is wrapped at
spaces only, so that an option name stays whole, as it stands on a wide one."""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Callable

import pytest

from nvrx.help_format import HelpFormatter
from nvrx.report.cli import _parser as report_parser
from nvrx.slurm.template_cli import build_parser as template_parser
from nvrx.store.server_process import build_parser as store_parser
from nvrx.supervisor.cli import build_parser as supervisor_parser

#: Every program with an argparse command line (``nvrx-srun``'s help is text of its own).
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "nvrx-supervise": supervisor_parser,
    "nvrx-report": report_parser,
    "nvrx-template": template_parser,
    "python -m nvrx.store.service": store_parser,
}
#: An option name where it starts (not the hyphen inside a word such as "fault-tolerance").
OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def _help(monkeypatch: pytest.MonkeyPatch, program: str, columns: int) -> tuple[str, set[str]]:
    """The help of ``program`` at ``columns``, and the names of the options it shows."""
    monkeypatch.setenv("COLUMNS", str(columns))
    parser = PARSERS[program]()
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS]
    return parser.format_help(), {name for action in shown for name in action.option_strings}


@pytest.mark.parametrize("columns", [60, 40])
@pytest.mark.parametrize("program", sorted(PARSERS))
def test_every_option_name_stays_whole_on_a_narrow_terminal(
    monkeypatch: pytest.MonkeyPatch, program: str, columns: int
) -> None:
    """Before: argparse broke a word after a hyphen, ``--master-`` at the end of one line and
    ``addr`` at the start of the next."""
    wide, names = _help(monkeypatch, program, 1000)  # nothing wrapped
    narrow, _ = _help(monkeypatch, program, columns)
    assert narrow != wide  # it was wrapped
    assert Counter(OPTION.findall(narrow)) == Counter(OPTION.findall(wide))
    assert names <= set(OPTION.findall(narrow))
    split = [line for line in narrow.splitlines() if line.endswith("-") and line[-2:-1].isalnum()]
    assert split == [], narrow


def test_each_line_of_an_epilog_is_filled_and_a_list_continues_under_its_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "34")  # 32 for the text
    parser = argparse.ArgumentParser(
        prog="p",
        usage="p",
        epilog="exit codes, as the --max-restarts option says:\n"
        "    4  job-wide restart budget (--max-restarts) used up\n"
        "  128+N  stopped by signal N",
        formatter_class=HelpFormatter,
    )
    assert parser.format_help().split("\n\n")[-1].splitlines() == [
        "exit codes, as the",
        "--max-restarts option says:",
        "    4  job-wide restart budget",
        "       (--max-restarts) used up",
        "  128+N  stopped by signal N",
    ]


def test_a_no_break_space_in_an_option_help_stays_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse gathers the ASCII whitespace of a help text only: a no-break space (U+00A0)
    that holds a number to its unit stays, and no line breaks there."""
    monkeypatch.setenv("COLUMNS", "40")
    parser = argparse.ArgumentParser(prog="p", usage="p", formatter_class=HelpFormatter)
    parser.add_argument("--wait", help="wait for a while, at most 5\u00a0s, then go on with it")
    assert "5\u00a0s" in parser.format_help()
