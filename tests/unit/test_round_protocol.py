"""The round protocol lives in one module: nobody else under ``nvrx/`` spells a key of it.

``nvrx.store.rounds`` declares every key of a restart round and of a process generation
(``KEY_NAMES``) with who writes it in which order. The Wrapper, its monitor and the
supervisor call its functions. These checks read every module under ``nvrx/`` with
``ast`` and fail on, outside ``rounds``:

- a key name of ``rounds`` reached for, however the module is bound (``rounds``, an
  alias, ``self.link.rounds``, ``getattr``), imported by name or by ``*``, or a private
  name of it;
- a string that starts with ``nvrx/``, the root of every key (outside the key layout);
- an import of ``nvrx.store.keys`` outside the modules that own its keys, relative
  imports resolved.

So does a module of the protocol that comes back (``generations``, ``gone_ranks``,
``lost_ranks``, ``death_between_rounds``), and a key of ``rounds`` missing from
``KEY_NAMES``.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from nvrx.store import rounds

PACKAGE = Path(__file__).resolve().parents[2] / "nvrx"
PROTOCOL = PACKAGE / "store" / "rounds.py"
KEY_LAYOUT = PACKAGE / "store" / "keys.py"
ROUNDS = "nvrx.store.rounds"
KEYS = "nvrx.store.keys"
#: The modules that may import ``nvrx.store.keys``: the protocol, and the keys of host
#: liveness without a supervisor (the host ring).
KEY_LAYOUT_USERS = {PROTOCOL, PACKAGE / "store" / "host_ring.py"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _package(path: Path) -> str:
    """The package a module at ``path`` is in (``nvrx.inprocess``), for relative imports;
    a module outside ``nvrx/`` (a check's own sample) counts as a module of ``nvrx.store``."""
    try:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    except ValueError:
        return "nvrx.store"
    return ".".join(parts[:-1])


def _imported(node: ast.ImportFrom, package: str) -> str:
    """The module ``node`` imports from, relative imports resolved."""
    return importlib.util.resolve_name("." * node.level + (node.module or ""), package)


def _bound_to(tree: ast.AST, package: str, module: str) -> set[str]:
    """The names a module binds to ``module`` (``rounds``, ``nvrx_rounds``, ``r``...)."""
    parent, _, leaf = module.rpartition(".")
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _imported(node, package) == parent:
            names |= {a.asname or a.name for a in node.names if a.name == leaf}
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == module and a.asname}
    return names


def _is_rounds(node: ast.expr, aliases: set[str]) -> bool:
    """Whether ``node`` names the rounds module: an alias, ``x.rounds``, ``nvrx.store.rounds``."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr == "rounds"


def _forbidden(name: str) -> bool:
    return name in rounds.KEY_NAMES or name.startswith("_") or name == "*"


def _key_uses(tree: ast.AST, package: str) -> Iterator[tuple[int, str]]:
    """(line, what) of each key of ``rounds`` the module reaches for."""
    aliases = _bound_to(tree, package, ROUNDS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_rounds(node.value, aliases):
            if _forbidden(node.attr):
                yield node.lineno, node.attr
        elif isinstance(node, ast.ImportFrom) and _imported(node, package) == ROUNDS:
            yield from ((node.lineno, a.name) for a in node.names if _forbidden(a.name))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id == "getattr" and len(args) >= 2 and _is_rounds(args[0], aliases):
                if isinstance(args[1], ast.Constant) and _forbidden(str(args[1].value)):
                    yield node.lineno, f"getattr {args[1].value}"


def _key_strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of each string that starts with the root of every key."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("nvrx/"):
                yield node.lineno, node.value


def key_spellers(paths: Iterable[Path]) -> list[str]:
    """``path:line what`` for each key of the protocol spelled outside it."""
    found = []
    for path in paths:
        if path == PROTOCOL:
            continue
        tree = ast.parse(path.read_text(), str(path))
        uses = list(_key_uses(tree, _package(path)))
        if path != KEY_LAYOUT:
            uses += _key_strings(tree)
        found += [f"{path}:{line} {what}" for line, what in uses]
    return found


def imports_key_layout(path: Path) -> bool:
    """Whether the module at ``path`` imports ``nvrx.store.keys``, by any spelling."""
    tree, package = ast.parse(path.read_text(), str(path)), _package(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == KEYS for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom):
            module, names = _imported(node, package), {a.name for a in node.names}
            if module == KEYS or (module == "nvrx.store" and "keys" in names):
                return True
        if isinstance(node, ast.Constant) and node.value == KEYS:  # importlib, by name
            return True
    return False


def test_no_module_but_the_protocol_spells_a_key_of_a_round():
    modules = _modules()
    assert len(modules) > 100, f"only {len(modules)} modules found under {PACKAGE}"
    assert key_spellers(modules) == []


def test_only_the_owners_of_keys_import_the_key_layout():
    outside = [p for p in _modules() if p not in KEY_LAYOUT_USERS and imports_key_layout(p)]
    assert outside == []


@pytest.mark.parametrize(
    "source",
    [
        "from nvrx.store import rounds\nrounds.DECISION\n",
        "from nvrx.store import rounds as r\nr.rank_state(0)\n",
        "import nvrx.store.rounds as r\nr.COMPLETED\n",
        "import nvrx.store.rounds\nnvrx.store.rounds.STARTED\n",
        "from . import rounds\nrounds.REJOIN\n",
        "from nvrx.store.rounds import rank_state\n",
        "from nvrx.store.rounds import *\n",
        "from nvrx.store import rounds\ngetattr(rounds, 'DECISION')\n",
        "from nvrx.store import rounds\nrounds._gone_record(0)\n",
        "class M:\n    def f(self):\n        return self.link.rounds.INTERRUPTED\n",
        "def f(g):\n    return f'nvrx/g{g}/termination'\n",
        "KEY = 'nvrx/round'\n",
    ],
)
def test_the_check_finds_a_key_spelled_outside(tmp_path, source):
    module = tmp_path / "writer.py"
    module.write_text(source)
    assert key_spellers([module]) != []


def test_the_check_lets_calls_of_the_protocol_pass(tmp_path):
    module = tmp_path / "writer.py"
    module.write_text(
        "from nvrx.store import rounds as r\nr.record_fault(None, None)\nr.DONE\n"
        "from nvrx.store.rounds import Admission, leave_round\n"
    )
    assert key_spellers([module]) == []


@pytest.mark.parametrize(
    "source",
    [
        "from nvrx.store import keys\n",
        "import nvrx.store.keys\n",
        "from nvrx.store.keys import ROOT\n",
        "from ..store import keys\n",
        "from ..store.keys import ROOT\n",
        "import importlib\nimportlib.import_module('nvrx.store.keys')\n",
    ],
)
def test_the_check_finds_an_import_of_the_key_layout(tmp_path, source):
    module = tmp_path / "writer.py"  # read as a module of nvrx.store (``_package``)
    module.write_text(source)
    assert imports_key_layout(module)


def test_relative_imports_are_resolved_from_the_modules_package():
    node = ast.parse("from ..store import keys\n").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _imported(node, "nvrx.inprocess") == "nvrx.store"
    assert _package(PACKAGE / "inprocess" / "agent_link.py") == "nvrx.inprocess"


def test_every_key_of_the_protocol_is_listed_and_every_listed_one_is_there():
    assert sorted(n for n in rounds.KEY_NAMES if not hasattr(rounds, n)) == []
    values = {
        name
        for name, value in vars(rounds).items()
        if name.isupper() and isinstance(value, str) and name not in {"DONE", "ROOT", "_TAKEN"}  # values, not keys
    }
    assert sorted(values - rounds.KEY_NAMES) == []


@pytest.mark.parametrize(
    "gone",
    [
        "store/generations.py",
        "store/faults.py",
        "store/gone_ranks.py",
        "inprocess/lost_ranks.py",
        "inprocess/death_between_rounds.py",
    ],
)
def test_the_protocol_is_not_spread_over_modules_again(gone):
    assert not (PACKAGE / gone).exists()
