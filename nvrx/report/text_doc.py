"""Text building blocks of the report's tables: times, durations, rank lists, and ``Doc``,
which collects sections as plain text or Markdown."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

from .compact import compress_ints

MAX_TRACE_LINES = 20
MAX_LIST_CHARS = 60


def when(wall: float | None) -> str:
    if wall is None:
        return "-"
    try:
        stamp = time.gmtime(wall)
    except (OverflowError, OSError, ValueError):  # a writer's garbage: say it, never crash
        return f"? (wall {wall!r})"
    return time.strftime("%Y-%m-%d %H:%M:%S", stamp) + f".{int((wall % 1) * 1000):03d}"


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


class Doc:
    """Collects sections, as plain text or Markdown."""

    def __init__(self, markdown: bool) -> None:
        self.markdown = markdown
        self.parts: list[str] = []

    def heading(self, title: str) -> None:
        self.parts.append(f"## {title}" if self.markdown else f"{title}\n{'=' * len(title)}")

    def table(self, rows: list[list[Any]], headers: Sequence[str]) -> None:
        fmt = "github" if self.markdown else "simple"
        if self.markdown:  # a "|" or newline in a cell would break the Markdown table
            rows = [[str(c).replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
        self.parts.append(
            tabulate(rows, headers=list(headers), tablefmt=fmt, disable_numparse=True)
        )

    def pairs(self, rows: list[list[str]]) -> None:
        """A two-column key/value table."""
        if self.markdown:
            self.table(rows, ["", ""])
        else:
            self.parts.append(tabulate(rows, tablefmt="plain", disable_numparse=True))

    def text(self, line: str) -> None:
        self.parts.append(line)

    def block(self, title: str, body: str) -> None:
        if self.markdown:
            self.parts.append(f"**{title}**\n\n```\n{body}\n```")
        else:
            indented = "\n".join("    " + line for line in body.splitlines())
            self.parts.append(f"{title}\n{indented}")

    def render(self) -> str:
        return "\n\n".join(self.parts) + "\n"
