"""Helpers shared by the test suites (not part of the nvrx package)."""
