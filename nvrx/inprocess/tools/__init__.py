"""Tools for testing in-process restart: ``inject_fault`` injects faults into a running rank."""

from . import inject_fault

__all__ = ["inject_fault"]
