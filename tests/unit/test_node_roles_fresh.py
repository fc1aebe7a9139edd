"""A slot declared lost after a store failover, before the survivors' new generation ran a
round: its spare starts with that generation (``NodeRoles.opening_fresh``); the slot next
in line to host the store is still told to keep one ready. Over a real store."""

from __future__ import annotations

import json
from typing import Any

from nvrx.store import rounds
from nvrx.store.seal import Sealer
from nvrx.supervisor import node_keys
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.node_roles import NodeRoles

SEALER = Sealer(bytes(range(32)), 0)


class _Link:
    """What the roles use of a store link, over a real ``TCPStore`` client."""

    lost = None

    def __init__(self, store: Any) -> None:
        self.store = store
        self.left: list[tuple[list[int], bool]] = []

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def add(self, key: str, amount: int = 1) -> int:
        return self.store.add(key, amount)

    def append(self, key: str, value: str) -> None:
        self.store.append(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return self.store.compare_set(key, expected, desired).decode()

    def leave_ranks(self, ranks: list[int], world_size: int, message: str, gone: bool) -> dict:
        self.left.append((ranks, gone))
        return {"round": None, "ranks": [], "out": []}

    def current_round(self) -> int | None:
        return rounds.current_round(self.store)


def _roles(base: Any, fresh_from: int | None) -> tuple[NodeRoles, _Link]:
    """Slot 2 of 6 (two spares, slots 4 and 5), after a failover to its own store."""
    job = local_job(nnodes=6, node_rank=2, nproc_per_node=1)
    cfg = SupervisorConfig(command=["train"], job=job, spare_nodes=2)
    link = _Link(base)
    roles = NodeRoles(cfg, link, lambda kind, **fields: None, lambda: SEALER)  # type: ignore[arg-type]
    roles.relink(cfg, link, 2, fresh_from)  # type: ignore[arg-type]
    return roles, link


def _assignment(base: Any, roles: NodeRoles, spare: int) -> dict[str, Any]:
    return json.loads(roles._chain(node_keys.assign(spare)).read(_Link(base)) or "{}")


def test_a_spare_starts_with_the_new_generation_until_it_ran_a_round(base) -> None:
    rounds.publish_round(base, 104)  # the last round the old store's snapshot knew
    roles, link = _roles(base, rounds.generation_after(104))
    roles.take_out({"slot": 0}, fresh=True)  # the successor's declaration of the old host
    loss = roles.take_out({"slot": 1})  # found silent in the new store
    assert loss is not None and (loss.action, loss.replaced_by) == ("spare", 5)
    assert _assignment(base, roles, 5)["fresh"] is True
    assert link.left[-1] == ([1], False)  # its spare's ranks arrive at the initial barrier
    # slot 1 was next in line to host the store: slot 3 is told to keep one ready
    assert roles._chain(node_keys.hold_store(3)).read(link) == "1"
    rounds.publish_round(base, 200)  # the new generation runs its first round
    assert not roles.opening_fresh() and roles.fresh_from is None


def test_a_spare_rejoins_once_the_new_generation_runs_or_without_a_failover(base) -> None:
    rounds.publish_round(base, 200)
    roles, _ = _roles(base, rounds.generation_after(104))
    roles.take_out({"slot": 1})
    assert _assignment(base, roles, 4)["fresh"] is False
    roles, _ = _roles(base, None)
    roles.take_out({"slot": 0})
    assert _assignment(base, roles, 5)["fresh"] is False
