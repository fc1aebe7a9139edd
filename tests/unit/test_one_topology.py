"""A job's topology has one type, the job-environment contract's ``JobEnv``.

No other class under ``nvrx/`` declares the topology's fields again, the
supervisor's config holds a ``JobEnv`` instead of its own copies, and no code
outside the contract and its SLURM reader builds a ``JobEnv`` or a config
field by field.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from nvrx.jobenv import JobEnv
from nvrx.supervisor.config import SupervisorConfig

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = {"nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port", "store_port"}
#: The one type, and the modules allowed to fill it in field by field.
OWNER = ("nvrx/jobenv.py", "JobEnv")
BUILDERS = {"nvrx/jobenv.py", "nvrx/slurm/topology.py"}


def _sources(*folders: str) -> Iterator[tuple[str, ast.Module]]:
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


def second_types(where: str, tree: ast.Module) -> list[str]:
    """Classes of ``tree`` that declare two or more of the topology's fields."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef) or (where, node.name) == OWNER:
            continue
        declared = {
            s.target.id
            for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        if len(declared & TOPOLOGY) >= 2:
            found.append(
                f"{where}:{node.lineno}: {node.name} declares {sorted(declared & TOPOLOGY)}"
            )
    return found


def field_by_field(where: str, tree: ast.Module) -> list[str]:
    """Calls of ``SupervisorConfig`` with a topology keyword, and of ``JobEnv`` with one
    outside the modules that build it."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        given = {k.arg for k in node.keywords} & TOPOLOGY
        if given and (name == "SupervisorConfig" or (name == "JobEnv" and where not in BUILDERS)):
            found.append(f"{where}:{node.lineno}: {name}(...) given {sorted(given)} one by one")
    return found


def test_no_second_type_declares_the_topology() -> None:
    found = [line for where, tree in _sources("nvrx") for line in second_types(where, tree)]
    assert not found, "\n".join(found)


def test_the_supervisor_config_holds_the_job_and_repeats_none_of_its_fields() -> None:
    config_fields = {f.name: f.type for f in dataclasses.fields(SupervisorConfig)}
    assert config_fields["job"] in (JobEnv, "JobEnv")
    assert not config_fields.keys() & {f.name for f in dataclasses.fields(JobEnv)}


def test_nobody_builds_the_topology_field_by_field() -> None:
    found = [line for where, tree in _sources("nvrx") for line in field_by_field(where, tree)]
    found += [
        line
        for where, tree in _sources("tests")
        for line in field_by_field(where, tree)
        if "SupervisorConfig" in line
    ]
    assert not found, "\n".join(found)


def test_the_checks_catch_a_copy() -> None:
    copy = ast.parse(
        "class Place:\n    nnodes: int\n    node_rank: int\n\n"
        "c = SupervisorConfig(['x'], nnodes=2)\nj = jobenv.JobEnv('1', master_port=1)\n"
    )
    assert second_types("nvrx/supervisor/place.py", copy) == [
        "nvrx/supervisor/place.py:1: Place declares ['nnodes', 'node_rank']"
    ]
    assert len(field_by_field("nvrx/supervisor/place.py", copy)) == 2
    assert len(field_by_field("nvrx/slurm/topology.py", copy)) == 1  # JobEnv's builder
