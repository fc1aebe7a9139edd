"""The round protocol lives in one module: nobody else under ``nvrx/`` spells a key of it.

``nvrx.store.rounds`` declares every key of a restart round and of a process generation
(``KEY_NAMES``) with who writes it in which order. The Wrapper, its monitor and the
supervisor call its functions. These checks read every module under ``nvrx/`` with
``ast``: a use of a key name of ``rounds`` outside it, or of the store's key layout
outside the modules that own its keys, fails here. So does a module of the protocol
that comes back (``generations``, ``gone_ranks``, ``lost_ranks``,
``death_between_rounds``), and a key name listed in ``KEY_NAMES`` that ``rounds`` lacks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvrx.store import rounds

PACKAGE = Path(__file__).resolve().parents[2] / "nvrx"
PROTOCOL = PACKAGE / "store" / "rounds.py"
#: The modules that may import ``nvrx.store.keys``: the root of every key and the keys
#: of host liveness without a supervisor (the host ring and its beats).
KEY_LAYOUT_USERS = {
    PACKAGE / "store" / "rounds.py",
    PACKAGE / "inprocess" / "host_ring.py",
    PACKAGE / "inprocess" / "host_beats.py",
}


def _modules() -> Iterator[Path]:
    yield from sorted(PACKAGE.rglob("*.py"))


def _key_uses(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) of each key name of ``rounds`` that the module reaches for."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in rounds.KEY_NAMES:
            base = node.value
            if isinstance(base, ast.Name) and base.id in {"rounds", "nvrx_rounds"}:
                yield node.lineno, node.attr
            if isinstance(base, ast.Attribute) and base.attr == "rounds":
                yield node.lineno, node.attr  # ``self.link.rounds.DECISION``
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("rounds"):
            for alias in node.names:
                if alias.name in rounds.KEY_NAMES:
                    yield node.lineno, alias.name


def _imports_key_layout(path: Path) -> bool:
    """Whether the module at ``path`` imports ``nvrx.store.keys``, by any spelling."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "nvrx.store.keys" for a in node.names):
            return True
        if not isinstance(node, ast.ImportFrom):
            continue
        names = {a.name for a in node.names}
        if node.module == "nvrx.store.keys" or (node.module == "nvrx.store" and "keys" in names):
            return True
        sibling = node.level == 1 and path.parent.name == "store"
        if sibling and (node.module == "keys" or (node.module is None and "keys" in names)):
            return True
    return False


def key_spellers(paths: Iterator[Path]) -> list[str]:
    """``path:line name`` for each use of a round key outside the protocol module."""
    found = []
    for path in paths:
        if path == PROTOCOL:
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{path}:{line} {name}" for line, name in _key_uses(tree)]
    return found


def test_no_module_but_the_protocol_spells_a_key_of_a_round():
    assert key_spellers(_modules()) == []


def test_only_the_owners_of_keys_import_the_key_layout():
    outside = [p for p in _modules() if p not in KEY_LAYOUT_USERS and _imports_key_layout(p)]
    assert outside == []


@pytest.mark.parametrize(
    "source",
    [
        "from nvrx.store import keys\n",
        "import nvrx.store.keys\n",
        "from nvrx.store.keys import ROOT\n",
    ],
)
def test_the_check_finds_an_import_of_the_key_layout(tmp_path, source):
    module = tmp_path / "writer.py"
    module.write_text(source)
    assert _imports_key_layout(module)


@pytest.mark.parametrize(
    "source",
    [
        "from nvrx.store import rounds\nrounds.DECISION\n",
        "from nvrx.store.rounds import rank_state\n",
        "class M:\n    def f(self):\n        return self.link.rounds.INTERRUPTED\n",
    ],
)
def test_the_check_finds_a_key_spelled_outside(tmp_path, source):
    module = tmp_path / "writer.py"
    module.write_text(source)
    assert key_spellers(iter([module])) != []


def test_the_check_lets_calls_of_the_protocol_pass(tmp_path):
    module = tmp_path / "writer.py"
    module.write_text("from nvrx.store import rounds\nrounds.record_fault(None, None)\n")
    assert key_spellers(iter([module])) == []


def test_every_listed_key_name_is_in_the_protocol_module():
    assert sorted(n for n in rounds.KEY_NAMES if not hasattr(rounds, n)) == []


@pytest.mark.parametrize(
    "gone",
    [
        "store/generations.py",
        "store/gone_ranks.py",
        "inprocess/lost_ranks.py",
        "inprocess/death_between_rounds.py",
    ],
)
def test_the_protocol_is_not_spread_over_modules_again(gone):
    assert not (PACKAGE / gone).exists()
