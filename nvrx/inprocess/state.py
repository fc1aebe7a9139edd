"""State of the in-process Wrapper as its plug-ins see it.

``State`` is the Wrapper's own, mutable record; every user plug-in receives a
``FrozenState`` snapshot, so that a plug-in cannot change the Wrapper's view by
accident (assigning a field raises ``dataclasses.FrozenInstanceError``).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Iterable
from typing import Any


class Mode(enum.Enum):
    """Operational mode of this rank.

    INITIALIZED: the State exists, no rank assignment ran yet.
    ACTIVE: the rank runs the wrapped function.
    INACTIVE: the rank is a spare and waits.
    TERMINATED: the rank left the job.
    """

    INITIALIZED = enum.auto()
    ACTIVE = enum.auto()
    INACTIVE = enum.auto()
    TERMINATED = enum.auto()


def _env_int(env: dict[str, str] | os._Environ[str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


@dataclasses.dataclass
class State:
    """The Wrapper's view of this rank.

    rank / world_size: rank among the Wrapper's healthy ranks (None once terminated)
    and their number. active_rank / active_world_size: what the wrapped function
    sees (active_rank is None on a spare). initial_rank / initial_world_size: the
    values when the Wrapper was entered. iteration: restart round index. mode: see
    ``Mode``. fn_exception: the exception the wrapped function raised on this rank
    in the current round, None elsewhere.
    """

    rank: int | None
    world_size: int

    active_rank: int | None = None
    active_world_size: int | None = None

    initial_rank: int | None = None
    initial_world_size: int | None = None

    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None

    def __post_init__(self) -> None:
        if self.initial_rank is None:
            self.initial_rank = self.rank
        if self.initial_world_size is None:
            self.initial_world_size = self.world_size

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> State:
        """State of a fresh Wrapper from ``RANK`` and ``WORLD_SIZE`` (defaults 0 and 1)."""
        env = os.environ if env is None else env
        rank = _env_int(env, "RANK", 0)
        world_size = _env_int(env, "WORLD_SIZE", 1)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"RANK must be in [0, WORLD_SIZE) and WORLD_SIZE >= 1, got RANK={rank} "
                f"WORLD_SIZE={world_size}"
            )
        return cls(rank=rank, world_size=world_size)

    def set_distributed_vars(self) -> None:
        """Publish the active rank and world size in ``RANK``/``WORLD_SIZE`` for the function.

        A spare has no rank the function could use: ``RANK`` is removed rather
        than set to the string ``'None'`` as the reference does.
        """
        if self.active_rank is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = str(self.active_rank)
        if self.active_world_size is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = str(self.active_world_size)

    def advance(self) -> None:
        """Move to the next restart round; the previous round's exception is forgotten."""
        self.iteration += 1
        self.fn_exception = None

    def freeze(self) -> FrozenState:
        """Read-only snapshot for plug-ins.

        Fields are copied by reference (not deep-copied as in the reference), so
        ``fn_exception`` keeps its traceback and exceptions that cannot be
        copied do not break the restart.
        """
        return FrozenState(**_fields_of(self))

    def copy_from(self, other: Any, fields: Iterable[str] | None = None) -> None:
        """Take the values of ``fields`` (all when None) from another State or FrozenState."""
        names = {f.name for f in dataclasses.fields(self)}
        wanted = names if fields is None else set(fields)
        unknown = wanted - names
        if unknown:
            raise ValueError(
                f"copy_from: unknown State fields {sorted(unknown)}; known: {sorted(names)}"
            )
        for name in wanted:
            setattr(self, name, getattr(other, name))


def _fields_of(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@dataclasses.dataclass(frozen=True)
class FrozenState:
    """``State`` with read-only fields: what every plug-in receives."""

    rank: int | None
    world_size: int

    active_rank: int | None = None
    active_world_size: int | None = None

    initial_rank: int | None = None
    initial_world_size: int | None = None

    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None

    def thaw(self) -> State:
        """A mutable State with the same values (for plug-ins that build a modified state)."""
        return State(**_fields_of(self))


assert [f.name for f in dataclasses.fields(State)] == [
    f.name for f in dataclasses.fields(FrozenState)
], "State and FrozenState must declare the same fields"

__all__ = ["FrozenState", "Mode", "State"]
