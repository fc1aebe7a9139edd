"""A rank's event file decoded into typed records, one per line, its common fields checked there.

Most of a big job's events are its ranks' (the Wrapper, its monitor, the app),
millions of them. With msgspec installed (``pip install 'nvrx[fast]'``), a
well-formed file whose events are all of ``RANK_KINDS``, each with every
common field of the writer's own type and in the bounds of
``nvrx.events.validation``, decodes into one record per event: the fold
(``FileFolder.fold_records``) then checks nothing per event. Any other file
(another kind, a common field missing, null where the writer writes a value,
of another type or out of bounds, a line that is not exactly one event) is
read as dicts, as without msgspec: ``decode_records`` returns None. A
whole-second ``wall`` or ``mono`` written as an integer becomes that float, as
the fold makes it (``values.num``).

A record holds the common fields and its kind's documented fields
(``schema.KINDS``), None where the event has none; other fields are dropped,
so a kind handler reads documented fields only. ``get`` reads a record as a
dict's ``get`` reads an event, so the kind handlers take either.
"""

# No ``from __future__ import annotations``: msgspec reads the record types' annotations, which
# name a local alias.
from typing import Annotated, Any, Union

from nvrx.events.schema import COMMON_FIELDS, KINDS
from nvrx.events.validation import MAX_ID, MAX_MONO, MAX_VERSION, MAX_WALL

from .loading import parse_lines

try:  # optional: without it every file is read as dicts
    import msgspec
except ImportError:  # pragma: no cover - depends on the environment
    msgspec = None  # type: ignore[assignment]

#: Kinds a training rank's processes write. Per-node kinds (supervisor, store) are few and are
#: read as dicts; so is any file that holds one.
RANK_KINDS = (
    "process_start",
    "process_end",
    "round_start",
    "call_start",
    "call_end",
    "fault",
    "restart_phase",
    "restarter_state",
    "rank_change",
    "ranks_terminated",
    "hang",
    "round_end",
    "wrapper_end",
    "checkpoint",
    "progress",
    "state_restored",
)


def _record_types() -> dict[str, type]:
    """One record type per kind of ``RANK_KINDS``, tagged by ``kind`` (needs msgspec)."""
    Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]

    class Record(msgspec.Struct, tag_field="kind", gc=False):
        """The common fields, with the types and bounds of the writer's usual event."""

        v: Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]
        wall: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WALL)]
        mono: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_MONO)]
        pid: Annotated[int, msgspec.Meta(ge=1, le=MAX_ID)]
        node: Id | None
        rank: Id | None
        round: Id | None
        host: str
        boot: str
        component: str
        job: str | None
        slurm_run: Any = None  # absent from older writers' events; read as the dicts' is

        def get(self, name: str, default: Any = None) -> Any:
            """The field ``name``, or ``default`` where the record has none (as ``dict.get``)."""
            return getattr(self, name, default)

    types = {}
    for kind in RANK_KINDS:
        own = [(name, Any, None) for name in KINDS[kind] if name not in COMMON_FIELDS]
        types[kind] = msgspec.defstruct(
            kind, own, bases=(Record,), tag=kind, gc=False, namespace={"kind": kind}
        )
    return types


#: The record type of each kind of ``RANK_KINDS``; empty without msgspec.
RECORD_TYPES: dict[str, type] = _record_types() if msgspec is not None else {}
_DECODER = (
    msgspec.json.Decoder(Union[tuple(RECORD_TYPES.values())])  # noqa: UP007 (a runtime tuple)
    if RECORD_TYPES
    else None
)


def _utf8(data: bytes) -> bool:
    """Whether ``data`` is UTF-8 throughout: the decoder does not look inside the fields it drops,
    and the reader skips a line that does not decode."""
    if data.isascii():
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def decode_records(data: bytes) -> list[Any] | None:
    """The records of a well-formed file's bytes, one per line, in file order; None without
    msgspec, or when a line is not exactly one usual event of ``RANK_KINDS`` (a blank line, an
    event torn over lines or merged with another: all for the reader), or is one the reader
    alone can judge (``loading.split_lines``)."""
    if _DECODER is None or not data.endswith(b"\n") or not _utf8(data):
        return None
    return parse_lines(data, _DECODER.decode)  # msgspec's errors are ValueErrors


__all__ = ["RANK_KINDS", "RECORD_TYPES", "decode_records"]
