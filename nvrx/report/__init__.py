"""``nvrx-report``: a job's event logs (and SLURM records) read into one summary.

``build_report(log_dir, job=None, ...) -> Report``; ``Report.to_dict()`` is the
versioned JSON form (``report.schema.json``), ``Report.to_text(format)`` the
printed one. Reads files only: no torch, no writes to the logs.
"""

from nvrx.events.failures import parse_traceback

from .build import Report, build_report
from .loading import ReportError
from .model import REPORT_SCHEMA_NAME, REPORT_SCHEMA_VERSION

__all__ = [
    "REPORT_SCHEMA_NAME",
    "REPORT_SCHEMA_VERSION",
    "Report",
    "ReportError",
    "build_report",
    "parse_traceback",
]
