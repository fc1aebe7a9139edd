"""A hang's stack dump as the report prints it: the user's stuck threads first.

A dump (Python's ``faulthandler``, every thread) lists threads in the order
the interpreter keeps them, so nvrx's own threads (the Wrapper's monitor, the
heartbeat and watchdog threads) often come before the thread that is stuck
in the user's code. Someone reading a hang wants that thread first: a thread
with a frame of user code (``nvrx.events.failures.is_user_frame``) goes
before one whose frames are all nvrx's, the standard library's or a
library's; the order is kept otherwise.
"""

from __future__ import annotations

from nvrx.events.failures import is_user_frame

#: How a thread's section of a dump starts: ``Thread 0x...`` or ``Current thread 0x...``.
_THREAD_HEADS = ("Thread ", "Current thread ")
_FRAME_HEAD = 'File "'


def _sections(stack: str) -> tuple[list[str], list[list[str]]]:
    """The lines before the first thread, and each thread's lines."""
    head: list[str] = []
    threads: list[list[str]] = []
    for line in stack.splitlines():
        if line.startswith(_THREAD_HEADS):
            threads.append([line])
        elif threads:
            threads[-1].append(line)
        else:
            head.append(line)
    return head, threads


def _frame_path(line: str) -> str | None:
    text = line.strip()
    if not text.startswith(_FRAME_HEAD):
        return None
    return text[len(_FRAME_HEAD) :].partition('"')[0]


def runs_user_code(thread: list[str]) -> bool:
    """Whether one thread's section has a frame of the user's code."""
    return any((path := _frame_path(line)) is not None and is_user_frame(path) for line in thread)


def stuck_first(stack: str) -> str:
    """``stack`` with the threads that run user code before the others (nvrx's own)."""
    head, threads = _sections(stack)
    if len(threads) < 2:
        return stack
    ordered = [t for t in threads if runs_user_code(t)] + [
        t for t in threads if not runs_user_code(t)
    ]
    if ordered == threads:
        return stack
    lines = head + [line for thread in ordered for line in _spaced(thread)]
    return "\n".join(lines).rstrip("\n")


def _spaced(thread: list[str]) -> list[str]:
    """A thread's lines ending with one blank line, as the dump separates them."""
    while thread and not thread[-1].strip():
        thread = thread[:-1]
    return [*thread, ""]
