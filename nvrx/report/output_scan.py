"""Reading a job's stdout/stderr files into items: tracebacks, stack dumps and fatal lines.

Several processes write to one output file, so lines of different processes
interleave. Each line is filed under the process that printed it as far as its
prefixes tell (srun ``--label`` ``N: ``, torch's ``[rankN]:``), and a traceback
is collected from the lines of one such stream only. Whether an item is a
failure is decided later, against the events (``output_triage``): scanning
only says what was printed and by whom.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from nvrx.events.failures import (
    TRACEBACK_HEADER,
    exit_signature,
    hang_signature,
    is_exception_line,
    parse_int,
    parse_traceback,
    signal_signature,
    slurm_signature,
)

log = logging.getLogger(__name__)

#: What an item is: a Python traceback, a faulthandler-style stack dump, or a fatal line.
TRACEBACK, STACK_DUMP, FATAL = "traceback", "stack_dump", "fatal"
#: Signature of a stack dump that is not a hang's (a dump on request, a peer's diagnostic).
DUMP_SIGNATURE = "stack dump"
MAX_BLOCK_LINES = 400
#: Most tasks one srun line is read to name.
MAX_TASKS = 4096
#: Lines of other (unprefixed) processes tolerated inside one traceback.
MAX_FOREIGN_LINES = 200

# Numbers are ASCII digits, at most 9 of them (``failures.parse_int``).
_LABEL = re.compile(r"^\s*([0-9]{1,9}): ")  # srun --label
_TORCH_RANK = re.compile(r"^\[rank([0-9]{1,9})\]: ?")  # torch's per-rank log prefix
_FRAME_LINE = re.compile(r'^\s+File "')
_CHAIN_LINES = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
_DUMP_HEADER = re.compile(
    r"^(Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):\s*$"
    r"|^Stack \(most recent call first\):\s*$"
)
_DUMP_TIMEOUT = re.compile(r"^Timeout \([0-9]+:[0-9][0-9]:[0-9][0-9](\.[0-9]+)?\)!\s*$")
_SRUN_TASK = re.compile(r"srun: error: (?P<host>\S+): tasks? (?P<tasks>[0-9,\-]+): (?P<what>.+)$")
#: Out of memory, as SLURM (not a process of the job) says it.
OUT_OF_MEMORY = slurm_signature("out of memory")
_SRUN_ENDS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^Killed$"), signal_signature("SIGKILL")),
    (re.compile(r"^Segmentation fault"), signal_signature("SIGSEGV")),
    (re.compile(r"^Aborted"), signal_signature("SIGABRT")),
    (re.compile(r"^Bus error"), signal_signature("SIGBUS")),
    (re.compile(r"^Terminated$"), signal_signature("SIGTERM")),
    (re.compile(r"^Out Of Memory$"), OUT_OF_MEMORY),
)
_SRUN_EXIT = re.compile(r"^Exited with exit code ([0-9]{1,9})$")
_CANCELLED = r"\*\*\* (JOB|STEP) \S+ ON \S+ CANCELLED AT \S+"
# Fatal lines that the interpreter, bash or SLURM print when a process or the job dies.
_FATAL_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Fatal Python error: Segmentation fault"), signal_signature("SIGSEGV")),
    (re.compile(r"Fatal Python error: Aborted"), signal_signature("SIGABRT")),
    (re.compile(r"Fatal Python error: Bus error"), signal_signature("SIGBUS")),
    (re.compile(r"^(.*\s)?Segmentation fault( \(core dumped\))?\s*$"), signal_signature("SIGSEGV")),
    (re.compile(r"^(.*\s)?Bus error( \(core dumped\))?\s*$"), signal_signature("SIGBUS")),
    (re.compile(_CANCELLED + r" DUE TO TIME LIMIT"), slurm_signature("time limit")),
    (re.compile(_CANCELLED + r" DUE TO NODE FAILURE"), slurm_signature("node failure")),
    (re.compile(_CANCELLED + r" DUE TO PREEMPTION"), slurm_signature("preemption")),
    (re.compile(_CANCELLED + r"\s*\*\*\*"), slurm_signature("cancelled")),
    # SLURM's and the kernel's OOM killer; not "CUDA out of memory" of a live rank.
    (re.compile(r"slurmstepd: error: Detected [0-9]+ oom[-_]kill event"), OUT_OF_MEMORY),
    (re.compile(r"slurmstepd: error: .*Out Of Memory"), OUT_OF_MEMORY),
    (
        re.compile(r"(Memory cgroup out of memory|Out of memory): Kill(ed)? process [0-9]"),
        OUT_OF_MEMORY,
    ),
)


@dataclass
class OutputItem:
    """One thing printed to an output file, with what its prefixes say about who printed it."""

    path: str
    line: int
    what: str  # TRACEBACK | STACK_DUMP | FATAL
    signature: str
    text: str
    task: int | None = None  # srun task (``--label`` prefix, or the submitit file's task)
    rank: int | None = None  # global rank from torch's ``[rankN]:`` prefix
    srun_tasks: tuple[int, ...] = ()  # tasks that srun's own fatal line names
    srun_host: str | None = None  # host that srun's own fatal line names
    exit_code: int | None = None  # the exit code srun's line gives
    exc_type: str | None = None  # a traceback's exception type


@dataclass
class _Block:
    """Lines of one traceback or stack dump being collected from one stream."""

    what: str
    start_line: int
    # Text before the header on its line (a logger's prefix), stripped from later lines.
    residue: str
    lines: list[str]
    signature: str = ""
    foreign: int = 0
    chained: bool = False


@dataclass
class _Stream:
    """Where one line came from, and the line without its prefixes."""

    task: int | None
    rank: int | None
    body: str


def split_prefixes(line: str, task: int | None = None) -> _Stream:
    """Strip srun's ``N: `` and torch's ``[rankN]:`` prefixes from ``line``."""
    match = _LABEL.match(line)
    if match:
        task, line = int(match[1]), line[match.end() :]
    rank = None
    match = _TORCH_RANK.match(line)
    if match:
        rank, line = int(match[1]), line[match.end() :]
    return _Stream(task, rank, line)


def _expand_tasks(text: str) -> tuple[int, ...]:
    """``0-2,5`` -> (0, 1, 2, 5): at most ``MAX_TASKS`` of them, however wide the ranges."""
    tasks: list[int] = []
    for part in text.split(","):
        low_text, dash, high_text = part.partition("-")
        low = parse_int(low_text)
        high = parse_int(high_text) if dash else low
        if low is None or high is None or low < 0:
            continue
        tasks.extend(range(low, min(high, low + MAX_TASKS - len(tasks) - 1) + 1))
        if len(tasks) >= MAX_TASKS:
            break
    return tuple(tasks)


@dataclass(frozen=True)
class _Fatal:
    signature: str
    tasks: tuple[int, ...] = ()
    host: str | None = None
    exit_code: int | None = None


def _fatal(body: str) -> _Fatal | None:
    """What a fatal line says, or None for any other line."""
    match = _SRUN_TASK.search(body)
    if match:
        tasks, host, what = _expand_tasks(match["tasks"]), match["host"], match["what"].strip()
        code = _SRUN_EXIT.match(what)
        if code:
            return _Fatal(exit_signature(int(code[1])), tasks, host, int(code[1]))
        for pattern, signature in _SRUN_ENDS:
            if pattern.match(what):
                return _Fatal(signature, tasks, host)
        return None
    for pattern, signature in _FATAL_PATTERNS:
        if pattern.search(body):
            return _Fatal(signature)
    return None


class _Scanner:
    """Collects blocks per stream (task, rank) and yields finished items."""

    def __init__(self, path: str, task: int | None) -> None:
        self.path, self.task = path, task
        self.blocks: dict[tuple[int | None, int | None], _Block] = {}

    def feed(self, number: int, raw: str) -> Iterator[OutputItem]:
        s = split_prefixes(raw.rstrip("\n"), self.task)
        key = (s.task, s.rank)
        block = self.blocks.get(key)
        if block is not None:
            body = s.body[len(block.residue) :] if s.body.startswith(block.residue) else s.body
            done, consumed = self._extend(block, body)
            if done:
                del self.blocks[key]
                item = self._finish(block, s)
                if item is not None:
                    yield item
            if consumed:
                return
        yield from self._start(number, s, key)

    def _extend(self, block: _Block, body: str) -> tuple[bool, bool]:
        """Add ``body`` to ``block``: (block finished, line consumed)."""
        if len(block.lines) > MAX_BLOCK_LINES or block.foreign > MAX_FOREIGN_LINES:
            block.lines.clear()  # not a traceback after all (or an absurd one)
            return True, False
        if not body.strip() or body[0].isspace():
            block.lines.append(body)
            return False, True
        if block.what == STACK_DUMP:
            if _DUMP_HEADER.match(body):
                block.lines.append(body)
                return False, True
            return True, False
        if body.strip() in _CHAIN_LINES:
            block.lines.append(body)
            block.chained = True
            return False, True
        if body.startswith(TRACEBACK_HEADER):
            if not block.chained:  # another process's traceback: this one was cut short
                block.lines.clear()
                return True, False
            block.lines.append(body)
            block.chained = False
            return False, True
        if is_exception_line(body) and any(_FRAME_LINE.match(b) for b in block.lines):
            block.lines.append(body)
            return True, True
        block.foreign += 1  # a line of another process that has no prefix
        return False, True

    def _finish(self, block: _Block, s: _Stream) -> OutputItem | None:
        if not block.lines:
            return None
        text = "\n".join(block.lines)
        if block.what != TRACEBACK:
            return OutputItem(
                self.path, block.start_line, block.what, block.signature, text, s.task, s.rank
            )
        parsed = parse_traceback(text)
        if parsed is None:
            return None
        item = OutputItem(
            self.path, block.start_line, TRACEBACK, parsed.signature(), text, s.task, s.rank
        )
        item.exc_type = parsed.exc_type
        return item

    def _start(
        self, number: int, s: _Stream, key: tuple[int | None, int | None]
    ) -> Iterator[OutputItem]:
        body = s.body
        at = body.find(TRACEBACK_HEADER)
        if at >= 0:
            self.blocks[key] = _Block(TRACEBACK, number, body[:at], [TRACEBACK_HEADER])
            return
        if _DUMP_TIMEOUT.match(body):
            block = _Block(STACK_DUMP, number, "", [body], hang_signature("faulthandler"))
            self.blocks[key] = block
            return
        if _DUMP_HEADER.match(body):
            self.blocks[key] = _Block(STACK_DUMP, number, "", [body], DUMP_SIGNATURE)
            return
        fatal = _fatal(body)
        if fatal is not None:
            yield OutputItem(
                self.path,
                number,
                FATAL,
                fatal.signature,
                body.strip(),
                s.task,
                s.rank,
                fatal.tasks,
                fatal.host,
                fatal.exit_code,
            )

    def close(self) -> Iterator[OutputItem]:
        """Stack dumps still open at the end of the file are complete; tracebacks are not."""
        for (task, rank), block in self.blocks.items():
            if block.what == STACK_DUMP:
                item = self._finish(block, _Stream(task, rank, ""))
                if item is not None:
                    yield item
        self.blocks.clear()


def scan_lines(lines: Iterable[str], path: str, task: int | None = None) -> Iterator[OutputItem]:
    """Items printed in ``lines`` (of the file ``path``); ``task`` when the file is one task's."""
    scanner = _Scanner(path, task)
    for number, raw in enumerate(lines, start=1):
        yield from scanner.feed(number, raw)
    yield from scanner.close()


_SUBMITIT_TASK = re.compile(r"_([0-9]{1,9})_log\.(out|err)$")


def scan_output_file(path: Path) -> list[OutputItem]:
    """Every item of one output file; a submitit file ``<job>_<task>_log.out`` is one task's."""
    match = _SUBMITIT_TASK.search(path.name)
    task = int(match[1]) if match else None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return list(scan_lines(fh, str(path), task))
    except OSError as exc:
        log.warning("cannot read %s: %s", path, exc)
        raise
