"""``--ft-non-retryable-exception-file``: the seed's format, and where a failure's text comes from."""

from __future__ import annotations

import json
import os
import sys

import pytest

from nvrx.events import EventWriter
from nvrx.supervisor.cli import config_from_args
from nvrx.supervisor.config import ConfigError
from nvrx.supervisor.non_retryable import (
    PatternFileError,
    exception_text,
    first_match,
    load_patterns,
)


def test_patterns_skip_comments_and_empty_lines(tmp_path):
    path = tmp_path / "patterns.txt"
    path.write_text("# configuration\ninsufficient shared memory (shm)\n\n  # indented comment\nCUDA out of memory\n")
    assert load_patterns(path) == ["insufficient shared memory (shm)", "CUDA out of memory"]
    config, _ = config_from_args(["--ft-non-retryable-exception-file", str(path), "--", sys.executable], {})
    assert config.non_retryable_patterns == ["insufficient shared memory (shm)", "CUDA out of memory"]


def test_a_hash_after_the_start_of_a_line_is_part_of_its_pattern(tmp_path):
    path = tmp_path / "patterns.txt"
    path.write_text("NCCL error  # from the fabric\n")
    assert load_patterns(path) == ["NCCL error  # from the fabric"]


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "No such file"), ("# only a comment\n\n", "no pattern in it"), (b"\xff\xfe\x00", "not a text file")],
)
def test_unusable_pattern_files_are_named(tmp_path, content, message):
    path = tmp_path / "patterns.txt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(PatternFileError, match=message):
        load_patterns(path)
    with pytest.raises(ConfigError, match=f"--ft-non-retryable-exception-file {path}"):
        config_from_args(["--ft-non-retryable-exception-file", str(path), "--", sys.executable], {})


def test_matching_is_a_case_sensitive_substring_and_names_the_line():
    text = "ValueError: Invalid configuration\nTraceback (most recent call last):\n  File x"
    match = first_match(["invalid configuration", "Invalid configuration"], text, "events")
    assert (match.pattern, match.line, match.source) == ("Invalid configuration", "ValueError: Invalid configuration", "events")
    assert first_match(["Permission denied"], text, "events") is None


def test_the_text_comes_from_the_error_file_else_the_events(tmp_path):
    error = tmp_path / "error.json"
    error.write_text(json.dumps({"message": {"message": "OSError: Permission denied: '/data'",
                                             "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"t.py\", line 3, in <module>\nOSError: Permission denied: '/data'\n"}}}))  # fmt: skip
    text, source = exception_text(tmp_path, 1234, error)
    assert source == "error file" and "Permission denied: '/data'" in text and "t.py" in text
    # no error file: the process's last fault event
    writer = EventWriter(str(tmp_path), "app", {"job": "j", "node": 0, "rank": 0, "round": None})
    writer.emit("fault", fault_kind="exception", exc_type="builtins.MemoryError", message="Cannot allocate memory")
    writer.close()
    text, source = exception_text(tmp_path, os.getpid(), None)
    assert source == "events" and "Cannot allocate memory" in text
    assert exception_text(tmp_path, 999999, None) is None
