"""``Report``: the report's data (``model.ReportData``) with its printed forms.

What ``build_report`` returns. The renderers read ``ReportData``; this type,
above them, hands a report to the one its format asks for.
"""

from __future__ import annotations

from .model import ReportData
from .render import render
from .render_html import render_html
from .text_doc import TEXT_WIDTH


class Report(ReportData):
    """The whole report; ``to_dict`` is the JSON contract, ``to_text`` renders it."""

    def to_text(self, format: str = "table", width: int | None = TEXT_WIDTH) -> str:
        """Render as ``table`` (default), ``markdown``, ``json`` or ``html`` (a whole page).
        ``width``: the widest line of ``table`` (cells wrapped to fit; None: no limit)."""
        if format == "html":
            return render_html(self)
        return render(self, format, width)
