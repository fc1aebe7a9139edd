"""Structured events: the single record of what happened in a job (JSON lines)."""

from .reader import (
    ProcessKey,
    ReadStats,
    Skipped,
    event_files,
    iter_dir,
    iter_file,
    process_events,
    read_dir,
)
from .schema import COMMON_FIELDS, KINDS, SCHEMA_VERSION, STAMPED_FIELDS
from .writer import (
    EventWriter,
    configure,
    context_from_env,
    emit,
    get_writer,
    job_id_from_env,
    job_log_dir,
)

__all__ = [
    "COMMON_FIELDS",
    "KINDS",
    "SCHEMA_VERSION",
    "STAMPED_FIELDS",
    "EventWriter",
    "ProcessKey",
    "ReadStats",
    "Skipped",
    "configure",
    "context_from_env",
    "emit",
    "event_files",
    "get_writer",
    "iter_dir",
    "iter_file",
    "job_id_from_env",
    "job_log_dir",
    "process_events",
    "read_dir",
]
