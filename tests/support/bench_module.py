"""Import a script of ``bench/`` as a module, for tests of what it computes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str, as_name: str | None = None) -> ModuleType:
    """``bench/<name>.py``, imported as ``as_name`` (``bench_<name>`` by default: the
    scripts' names would shadow other modules), registered in ``sys.modules`` so that its
    classes and functions pickle."""
    spec = importlib.util.spec_from_file_location(as_name or f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
