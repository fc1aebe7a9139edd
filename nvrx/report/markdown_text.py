"""Text from the events, written into the report's Markdown so that a viewer (GitHub,
GitLab) shows it as it is: an exception's message, a signature, a host, a path or SLURM's
error is data, and its ``<class 'int'>``, ``__init__``, ``*args``, ``[x](y)`` or leading
``#`` or ``1.`` must not turn into HTML, emphasis, a link, a heading or a list.

Characters Markdown would read are escaped with a backslash (CommonMark renders an escaped
ASCII punctuation character as the character itself); code blocks get a fence no line of
theirs can close. GitHub reads more in the text once the Markdown is made HTML, where no
backslash is left to stop it: ``@name`` mentions (and notifies) someone, ``#123`` links an
issue, ``:name:`` is an emoji and ``$...$`` math; an invisible word joiner breaks each up.
The Markdown the report means (its headings, a block's bold title, the fences, the tables'
rules) is ``text_doc.Doc``'s, never passed through here.
"""

from __future__ import annotations

import re

#: What makes Markdown wherever it stands in a line: a backslash, code spans, emphasis,
#: links and images, raw HTML and autolinks, GFM's table cells and strikethrough, an
#: entity (a lone ``&`` is text), an underscore at a word's edge (``__init__``: inside a
#: word, ``snake_case``, CommonMark makes no emphasis of it), the ``:`` of ``://`` and
#: ``.`` of ``www.`` (GFM links a web address with its raw text up to a space, so a viewer
#: would show the backslashes escaped in it; escaped there, it stays text), and a ``$``, which
#: opens math in viewers that read ``$...$`` in Markdown (GitHub reads it later: below).
_INLINE = re.compile(r"[\\`*\[\]<|~$]|&(?=#?\w+;)|(?<![^\W_])_|_(?![^\W_])|:(?=//)|(?<=www)\.")
#: An invisible character that allows no line break where it stands.
WORD_JOINER = "\u2060"
#: Where GitHub reads its own syntax in a paragraph's or a cell's text after the Markdown is
#: parsed (in every text but code's), a backslash escape already spent: ``@`` before a
#: user's or team's name where no ASCII letter, digit or ``_`` stands before it (a mention,
#: which notifies them; ``user@host`` and a mail address mention no one, and are left whole
#: so that a command or address copied from the page still works), ``#`` before an issue's
#: number (``#123``, ``owner/repo#123``), ``:`` before an emoji's name (a letter or digit, or
#: ``+1``, ``-1``) and its closing ``:`` (a clock's ``12:30:45`` names none), and ``$``,
#: which opens or closes math. A word joiner after the first three or before the ``$`` (no
#: ``$`` of math follows a letter or such a character) leaves none of them whole.
_GITHUB_AFTER = re.compile(
    r"(?<![A-Za-z0-9_])@(?=[A-Za-z0-9])|#(?=\d)|:(?!\d{1,2}:)(?=[+-]?[^\W_][\w+-]*:)"
)
_GITHUB_BEFORE = re.compile(r"(?=\$)")
#: What makes a block of a line it starts (after its indent): a heading, a quote, a list
#: item, a thematic break, a heading's underline, or GFM's table delimiter row (``:--``),
#: which makes the line above a table's header and the lines below its rows.
_BLOCK_MARK = re.compile(r"^(\s*)([#>+=:-])")
#: An ordered list item's number at the start of a line (``1.``, ``2)``).
_LIST_NUMBER = re.compile(r"^(\s*\d{1,9})([.)])")
#: Line endings as Markdown reads them.
_LINE_END = re.compile(r"\r\n?|\n")
_ESCAPED = r"\1\\\2"
#: A space a Markdown viewer keeps at a line's start.
NBSP = "\u00a0"
#: Columns between tab stops in an indent: a terminal's, where the text report's tab shows.
TAB_SIZE = 8


def inline(text: str) -> str:
    """``text`` as Markdown that shows as it is on one line (a table's cell, a title): its
    line breaks become spaces, which a table row cannot hold."""
    return _escaped(_LINE_END.sub(" ", text))


def heading(text: str) -> str:
    """``text`` as the words of a Markdown heading: also its ``#``, which would end it."""
    return inline(text).replace("#", "\\#")


def paragraph(text: str) -> str:
    """``text`` as one Markdown paragraph that shows each line as it is, on a line of its
    own and indented as it is: no line starts a block (heading, quote, list), its blank
    lines are left out, which would end the paragraph and let the line after start one (an
    indented one, a code block); each line but the last ends in a hard line break (a
    viewer would join them), and an indent is of no-break spaces (a viewer strips spaces
    and tabs)."""
    lines = [_shown(line) for line in _LINE_END.split(text) if line.strip()]
    return "\\\n".join(lines)


def _shown(line: str) -> str:
    """One line of a paragraph, escaped, its indent of no-break spaces: a tab in it is as
    many as reach the next tab stop (a viewer strips a tab as it strips a space, and a tab
    before a paragraph's first line makes a code block of it)."""
    escaped = _LIST_NUMBER.sub(_ESCAPED, _BLOCK_MARK.sub(_ESCAPED, _escaped(line)))
    body = escaped.lstrip(" \t")
    indent = escaped[: len(escaped) - len(body)].expandtabs(TAB_SIZE)
    return NBSP * len(indent) + body


def _escaped(text: str) -> str:
    """``text`` with what Markdown and GitHub would read in it made inert, wherever it
    stands: the word joiners go in first, where the text's own characters tell where, and
    are nothing Markdown reads."""
    joined = _GITHUB_BEFORE.sub(WORD_JOINER, _GITHUB_AFTER.sub(r"\g<0>" + WORD_JOINER, text))
    return _INLINE.sub(r"\\\g<0>", joined)


def code_block(body: str) -> str:
    """``body`` as a fenced Markdown code block, verbatim: its fence is longer than any run
    of backticks in it, so no line of it (a traceback's, a message's) closes the block."""
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{body}\n{fence}"
