"""Text building blocks of the report's tables: times, durations, rank lists, commands to
run, and ``Doc``, which collects sections as plain text (each line fitted to a terminal's
width) or Markdown."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any

from tabulate import tabulate

from . import markdown_text as md
from .compact import compress_ints

MAX_TRACE_LINES = 20
MAX_LIST_CHARS = 60
#: Widest line of the plain-text report: a terminal's, or a pager's, without wrapping.
TEXT_WIDTH = 120
#: The narrowest width a report is fitted to (``--width``).
MIN_TEXT_WIDTH = 40
#: A table column is wrapped no narrower than this.
MIN_COLUMN = 6
#: Spaces between two columns of a plain-text table (tabulate's "simple" and "plain").
COLUMN_GAP = 2
#: What tabulate adds to the width of a header (its ``MIN_PADDING``).
HEADER_PAD = 2


def when(wall: float | None) -> str:
    if wall is None:
        return "-"
    try:
        # to the nearest millisecond: the events' 17.1 is .100, not the float's .0999...
        seconds, ms = divmod(round(wall * 1000), 1000)
        stamp = time.gmtime(seconds)
    except (OverflowError, OSError, ValueError):  # a writer's garbage: say it, never crash
        return f"? (wall {wall!r})"
    return time.strftime("%Y-%m-%d %H:%M:%S", stamp) + f".{ms:03d}"


def secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 120:
        return f"{value / 60:.1f} min"
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def ranks_text(values: Sequence[int]) -> str:
    text = compress_ints(values)
    if len(text) > MAX_LIST_CHARS:
        text = text[: MAX_LIST_CHARS - 3] + "..."
    return text or "-"


def trim(text: str | None) -> str:
    if not text:
        return ""
    lines = text.rstrip().splitlines()
    if len(lines) > MAX_TRACE_LINES:
        lines = [f"... ({len(lines) - MAX_TRACE_LINES} lines above)"] + lines[-MAX_TRACE_LINES:]
    return "\n".join(lines)


def where(node: int | None, host: str | None) -> str:
    if node is None and host is None:
        return "-"
    if host is None:
        return f"node {node}"
    return f"{host} (node {node})" if node is not None else host


def _cell_width(value: Any) -> int:
    return max((len(line) for line in str(value).splitlines()), default=0)


def _longest_word(value: Any) -> int:
    return max((len(word) for word in str(value).split()), default=0)


def fit_columns(
    rows: list[list[Any]], headers: Sequence[str], width: int, header_pad: int = 0
) -> list[int]:
    """Column widths that fit a table in ``width`` characters: the widest column is wrapped
    first, down to its longest word, then (if still too wide) to ``MIN_COLUMN``; a table of
    many columns may stay wider. ``header_pad``: what the table format adds to a header."""
    columns = max([len(headers), *(len(row) for row in rows)], default=0)
    widths, words = [0] * columns, [MIN_COLUMN] * columns
    for i, head in enumerate(headers):
        widths[i] = len(head) + header_pad
        words[i] = max(words[i], _longest_word(head) + header_pad)
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], _cell_width(cell))
            words[i] = max(words[i], _longest_word(cell))
    excess = sum(widths) + COLUMN_GAP * (columns - 1) - width
    for floors in (words, [MIN_COLUMN + header_pad] * columns):
        while excess > 0:
            widest = max(range(columns), key=lambda i: widths[i] - floors[i])
            if widths[widest] <= floors[widest]:
                break
            widths[widest] -= 1
            excess -= 1
    return widths


def wrap_line(line: str, width: int) -> list[str]:
    """``line`` in lines of at most ``width`` characters, continued under its indent."""
    if len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    return textwrap.wrap(
        line, width, subsequent_indent=indent, break_on_hyphens=False, drop_whitespace=True
    )


@dataclass(frozen=True)
class Command:
    """A command the report tells the user to run, on a line of its own: in text, indented
    ``indent`` spaces under the line that asks for it; in Markdown, a code block (there an
    indented line would run into the paragraph above it)."""

    line: str
    indent: int = 4

    def under(self, spaces: int) -> Command:
        """This command ``spaces`` further in: the lines it stands among are nested."""
        return replace(self, indent=self.indent + spaces)


class Doc:
    """Collects sections, as plain text or Markdown. Plain text is fitted to ``width``
    characters (None: as wide as its lines are); Markdown never is (its tables cannot wrap).
    In Markdown, the text it is given shows as it is (``markdown_text``): only its own
    headings, bold titles, code blocks and tables are Markdown."""

    def __init__(self, markdown: bool, width: int | None = TEXT_WIDTH) -> None:
        self.markdown = markdown
        self.width = None if markdown else width
        self.parts: list[str] = []

    def heading(self, title: str) -> None:
        self.parts.append(f"## {md.heading(title)}" if self.markdown else f"{title}\n{'=' * len(title)}")

    def table(self, rows: list[list[Any]], headers: Sequence[str]) -> None:
        fmt = "github" if self.markdown else "simple"
        if self.markdown:
            rows = [[md.inline(str(c)) for c in row] for row in rows]
            headers = [md.inline(h) for h in headers]
        self.parts.append(self._tabulate(rows, list(headers), fmt))

    def _tabulate(self, rows: list[list[Any]], headers: list[str], fmt: str) -> str:
        if self.width is None or not rows:
            return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)
        pad = HEADER_PAD if headers else 0
        widths = fit_columns(rows, headers, self.width, pad)
        return tabulate(
            [[str(c) for c in row] for row in rows],
            headers=headers,
            tablefmt=fmt,
            disable_numparse=True,
            maxcolwidths=widths,
            maxheadercolwidths=[w - pad for w in widths] if headers else None,
        )

    def pairs(self, rows: list[list[str]]) -> None:
        """A two-column key/value table."""
        if self.markdown:
            self.table(rows, ["", ""])
        else:
            self.parts.append(self._tabulate(rows, [], "plain"))

    def text(self, line: str) -> None:
        self.parts.append(md.paragraph(line) if self.markdown else self._fit(line))

    def lines(self, lines: Sequence[str | Command]) -> None:
        """Lines told together, each ``Command`` among them on a line of its own: one
        paragraph in text; in Markdown, its commands code blocks between its paragraphs."""
        if not self.markdown:
            self.text("\n".join(x if isinstance(x, str) else " " * x.indent + x.line for x in lines))
            return
        for code, run in groupby(lines, key=lambda x: isinstance(x, Command)):
            said = "\n".join(x.line if isinstance(x, Command) else x for x in run)
            self.parts.append(md.code_block(said) if code else md.paragraph(said))

    def outcome(self, line: str, verdict: str) -> None:
        """How the job ended (``verdict``: ok, failed, unfinished); in text, a line like any."""
        self.text(line)

    def block(self, title: str, body: str) -> None:
        if self.markdown:
            self.parts.append(f"**{md.inline(title)}**\n\n{md.code_block(body)}")
        else:
            indented = "\n".join("    " + line for line in body.splitlines())
            self.parts.append(self._fit(f"{title}\n{indented}"))

    def _fit(self, text: str) -> str:
        if self.width is None:
            return text
        width = self.width
        return "\n".join(out for line in text.splitlines() for out in wrap_line(line, width))

    def render(self) -> str:
        return "\n\n".join(self.parts) + "\n"
