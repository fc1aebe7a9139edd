"""How every nvrx program's ``--help`` is wrapped to the terminal: words never split.

argparse wraps with ``textwrap``'s defaults, which break a word after any of its
hyphens: on a narrow terminal ``--master-addr`` became ``--master-`` at the end
of one line and ``addr`` at the start of the next, a name no one can copy. Here
a line breaks only at spaces, and a word longer than the line stands whole on a
line of its own.

In a description or an epilog each line of the text is a paragraph of its own,
filled to the width: the text's own line breaks stay. A line that starts with
spaces is an entry of a list (``  code  what it means``): it keeps them, and
its continuations stand under its text.
"""

from __future__ import annotations

import argparse
import re
import textwrap

#: The whitespace argparse gathers into one space in a help text: ASCII only, so that a
#: no-break space (U+00A0) stays, as textwrap never breaks a line there either.
_WHITESPACE = re.compile(r"\s+", re.ASCII)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, wrapped at spaces only (``formatter_class`` of every nvrx parser)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = _WHITESPACE.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(_fill_line(line, width, indent) for line in text.splitlines())


def _fill_line(line: str, width: int, indent: str) -> str:
    """One line of a description or epilog, filled to ``width`` after ``indent``."""
    words = line.strip(" ")
    if not words:
        return ""
    lead = line[: len(line) - len(line.lstrip(" "))]
    hang = lead
    if lead and " " in words:  # an entry of a list: continued under its text
        first, rest = words.split(" ", 1)
        hang = lead + " " * (len(first) + 1 + len(rest) - len(rest.lstrip(" ")))
    return textwrap.fill(
        words,
        width,
        initial_indent=indent + lead,
        subsequent_indent=indent + hang,
        break_on_hyphens=False,
        break_long_words=False,
    )
