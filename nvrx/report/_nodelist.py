"""Compressed SLURM host lists (``node[01-03,07]``) for ``--exclude=``.

``nvrx.slurm.nodelist.compress_nodelist`` is used when it exists; this small
private version keeps the report usable without it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_NUMBERED = re.compile(r"^(?P<prefix>.*?)(?P<digits>\d+)$")


def _ranges(numbers: list[int], width: int) -> str:
    parts: list[str] = []
    start = prev = numbers[0]
    for n in numbers[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(
            f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}"
        )
        if n is not None:
            start = prev = n
    return ",".join(parts)


def compress_hosts(hosts: Iterable[str]) -> str:
    """``["n1", "n2", "n3", "gpu7"]`` -> ``"gpu7,n[1-3]"`` (hosts sharing prefix and digit width merge)."""
    groups: dict[tuple[str, int], set[int]] = {}
    plain: set[str] = set()
    for host in set(hosts):
        match = _NUMBERED.match(host)
        if match is None:
            plain.add(host)
            continue
        digits = match["digits"]
        # "node01" and "node1" are different hosts: only same-width numbers share a bracket.
        width = len(digits) if digits.startswith("0") else 0
        groups.setdefault((match["prefix"], width), set()).add(int(digits))
    # An unpadded number as wide as a padded group belongs to it: node09 + node10 -> node[09-10].
    for prefix, width in [key for key in groups if key[1] > 0]:
        loose = groups.get((prefix, 0), set())
        fitting = {n for n in loose if len(str(n)) == width}
        if fitting:
            groups[(prefix, width)] |= fitting
            loose -= fitting
            if not loose:
                del groups[(prefix, 0)]
    out = sorted(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        ordered = sorted(numbers)
        if len(ordered) == 1:
            out.append(f"{prefix}{ordered[0]:0{width}d}")
        else:
            out.append(f"{prefix}[{_ranges(ordered, width)}]")
    return ",".join(out)


def compress_nodelist(hosts: Iterable[str]) -> str:
    """The project's compressor when present, else :func:`compress_hosts`."""
    hosts = sorted(set(hosts))
    try:
        from nvrx.slurm.nodelist import compress_nodelist as project_compress
    except ImportError:
        return compress_hosts(hosts)
    try:
        return project_compress(hosts)
    except ValueError:  # a host name SLURM could not take (brackets, commas): list it as is
        return compress_hosts(hosts)


def compress_ints(values: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (rank lists in tables)."""
    ordered = sorted(set(values))
    return _ranges(ordered, 0) if ordered else ""
