"""The program of a warm standby: import torch, wait, then become a training rank.

Run by the supervisor as ``python -m nvrx.supervisor.standby_process``
(``nvrx.supervisor.standby``). It imports what a training script spends its
first seconds importing and starts the Wrapper's monitor process ahead; once
both are past their imports it writes one byte to the descriptor named by
``NVRX_STANDBY_READY_FD`` (if any) and closes it ("warm"), then blocks on the
descriptor named by ``NVRX_STANDBY_FD`` until the supervisor writes one JSON activation
(``{"argv": [...], "env": {...}}``) and closes it. It then takes that
environment and ``sys.argv`` and runs the script (``python script.py ...``)
or module (``python -m module ...``) as ``__main__``, as a fresh interpreter
would (``run``). End of file with no activation means "not needed": exit 0.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import runpy
import sys
import types
from importlib.machinery import SourceFileLoader
from pkgutil import get_importer

from nvrx.jobenv import STANDBY_FD as FD_ENV
from nvrx.jobenv import STANDBY_READY_FD as READY_FD_ENV

#: Modules imported while waiting: what training imports first and slowest (the first
#: optimizer imports ``torch._dynamo``; the Wrapper is ``nvrx.inprocess.wrap``).
WARM_IMPORTS = ("torch", "torch.distributed", "torch._dynamo", "nvrx.inprocess.wrap")
#: How long the standby waits for the imports of the monitor process it started ahead
#: before it says it is warm all the same.
MONITOR_IMPORT_TIMEOUT_S = 300.0


def _read_activation(fd: int) -> dict | None:
    with os.fdopen(fd, "rb") as pipe:
        data = pipe.read()
    if not data:
        return None
    activation = json.loads(data)
    if not isinstance(activation, dict):
        raise ValueError("activation is not a JSON object")
    return activation


def _warm_up() -> None:
    import importlib

    try:
        for name in WARM_IMPORTS:
            importlib.import_module(name)
        from nvrx.inprocess import monitor_process

        monitor_process.prestart()  # the Wrapper's monitor process, for a rank that uses it
        if not monitor_process.wait_prestarted(MONITOR_IMPORT_TIMEOUT_S):
            print("nvrx standby: the monitor process started ahead is not ready", file=sys.stderr)
    except Exception as exc:  # the script meets the same error itself, and reports it there
        print(f"nvrx standby: warm-up stopped: {type(exc).__name__}: {exc}", file=sys.stderr)


def _say_warm(fd: int | None) -> None:
    if fd is None:
        return
    try:
        os.write(fd, b"1")
    except OSError:  # the supervisor stopped listening: it still activates or discards it
        pass
    finally:
        os.close(fd)


def _fresh_main() -> dict:
    """A new, empty ``__main__`` module, as the interpreter makes one for a script."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={}, __cached__=None)
    sys.modules["__main__"] = main
    return main.__dict__


def _abspath(script: str) -> str:
    """``script`` made absolute as ``python`` makes it: the working directory, ``/`` and the
    script as given, not normalized (``./train.py`` is ``/cwd/./train.py`` in ``__file__``;
    from ``/``, ``train.py`` is ``//train.py``)."""
    if script in ("", "."):
        return os.getcwd()
    return script if os.path.isabs(script) else os.getcwd() + os.sep + script


def _compile(path: str, program: str) -> types.CodeType:
    """The script's code; one that cannot be read ends this process as ``python`` ends then
    (its message, status 2)."""
    try:
        source = io.open_code(path)
    except OSError as exc:
        print(f"{program}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    with source:
        return compile(source.read(), path, "exec", dont_inherit=True)


def run(argv: list[str], env: dict[str, str]) -> None:
    """Run the training command ``argv`` (``[python, script, ...]`` or ``[python, -m, module,
    ...]``) as ``__main__``, with what ``python`` itself sets: ``sys.argv``, ``sys.path[0]``,
    an absolute ``__file__``, a fresh ``__main__`` that stays after the script returns. A
    "script" that is a directory or zip file runs its ``__main__.py``, as ``python`` does."""
    os.environ.clear()
    os.environ.update(env)
    main_globals = _fresh_main()
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy._run_module_as_main(argv[2])  # what ``python -m`` runs; it sets argv[0]
        return
    script = argv[1]
    path = _abspath(script)
    sys.argv = list(argv[1:])
    safe_path = getattr(sys.flags, "safe_path", False)  # -P (Python 3.11+)
    if get_importer(path) is not None:  # a directory or zip file (zipapp): its ``__main__``
        if safe_path:
            sys.path.insert(0, path)  # added even so
        else:
            sys.path[0] = path
        runpy._run_module_as_main("__main__", alter_argv=False)  # what ``python`` runs then
        return
    if not safe_path:  # -P adds no script directory
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    code = _compile(path, argv[0])
    main_globals.update(__file__=path, __loader__=SourceFileLoader("__main__", path), __spec__=None)
    exec(code, main_globals)


def main() -> None:
    fd = int(os.environ.pop(FD_ENV))
    ready = os.environ.pop(READY_FD_ENV, None)
    _warm_up()
    _say_warm(None if ready is None else int(ready))
    activation = _read_activation(fd)
    if activation is None:
        return
    run(list(activation["argv"]), dict(activation["env"]))


if __name__ == "__main__":
    main()
