"""SLURM host lists: expand ``gpu[01-04,07],cpu-a[1-2]`` to names and back.

Our own implementation of the hostlist syntax that ``scontrol show hostnames``
accepts, so that nvrx needs no SLURM binary to read ``SLURM_JOB_NODELIST``.

Syntax (checked against SLURM 22.05's ``scontrol show hostnames``):

- items are separated by commas or whitespace outside brackets; empty items are
  skipped (``"a,,b"`` is ``a b``, as SLURM does);
- an item is literal text with any number of bracket groups, each a comma list
  of ``N`` or ``LO-HI`` (``LO <= HI``, digits only); several groups expand as a
  product, the first group varying slowest (``x[1-2]y[3-4]`` is ``x1y3 x1y4
  x2y3 x2y4``);
- a number is zero-padded to the length of the range's lower bound
  (``n[08-10]`` is ``n08 n09 n10``; ``n[8-10]`` is ``n8 n9 n10``);
- order and duplicates are kept (``n[2,1,1]`` is ``n2 n1 n1``).

Stricter than SLURM, on purpose: text after the last bracket group (SLURM also
rejects it), an unbalanced or nested bracket, an empty or non-numeric range,
``HI < LO``, an open range ``n[1-]`` (SLURM reads it as ``n1``) and spaces inside
brackets all raise ``ValueError`` quoting the input.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

#: Refuse to expand more names than this (a typo like ``n[1-999999999]``).
MAX_HOSTS = 1 << 20

_SEPARATORS = ",\t\n\r "
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TRAILING_DIGITS = re.compile(r"^(.*?)(\d+)$")
_FORBIDDEN_IN_NAME = set("[]," + " \t\n\r")


def _split_items(nodelist: str) -> list[str]:
    """Split at separators outside brackets, checking that brackets balance."""
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            if depth:
                raise ValueError(f"nested '[' at offset {i} in node list {nodelist!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"']' without '[' at offset {i} in node list {nodelist!r}")
            depth = 0
        elif ch in _SEPARATORS and not depth:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in node list {nodelist!r}")
    items.append(nodelist[start:])
    return [item for item in items if item]


def _expand_group(group: str, nodelist: str) -> list[str]:
    """Expand the inside of one bracket group, e.g. ``01-04,07``."""
    numbers: list[str] = []
    for element in group.split(","):
        match = _RANGE.fullmatch(element)
        if not match:
            raise ValueError(f"bad range {element!r} in [{group}] of node list {nodelist!r}")
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise ValueError(f"range {element!r} goes down, in node list {nodelist!r}")
        if len(numbers) + hi - lo + 1 > MAX_HOSTS:
            raise ValueError(f"node list {nodelist!r} expands to more than {MAX_HOSTS} names")
        width = len(lo_text)
        numbers.extend(str(k).zfill(width) for k in range(lo, hi + 1))
    return numbers


def _expand_item(item: str, nodelist: str) -> list[str]:
    """Expand one item (no top-level separators) into names."""
    parts = re.split(r"\[([^\]]*)\]", item)
    # parts alternates literal, group, literal, group, ..., literal
    literals, groups = parts[0::2], parts[1::2]
    if groups and literals[-1]:
        raise ValueError(
            f"text {literals[-1]!r} after the last ']' in {item!r} of node list {nodelist!r}"
        )
    expanded = [_expand_group(g, nodelist) for g in groups]
    total = 1
    for numbers in expanded:
        total *= len(numbers)
    if total > MAX_HOSTS:
        raise ValueError(f"node list {nodelist!r} expands to more than {MAX_HOSTS} names")
    names = []
    for combo in itertools.product(*expanded):
        pieces = [literals[0]]
        for number, literal in zip(combo, literals[1:], strict=True):
            pieces.append(number)
            pieces.append(literal)
        names.append("".join(pieces))
    return names


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list such as ``gpu[01-04,07],cpu-a[1-2]`` into host names.

    Order and duplicates are kept; ``""`` gives ``[]``. Raises ``ValueError``
    quoting the input when it is malformed (see the module docstring).
    """
    if not isinstance(nodelist, str):
        raise TypeError(f"node list must be a str, got {type(nodelist).__name__}: {nodelist!r}")
    names: list[str] = []
    for item in _split_items(nodelist):
        names.extend(_expand_item(item, nodelist))
        if len(names) > MAX_HOSTS:
            raise ValueError(f"node list {nodelist!r} expands to more than {MAX_HOSTS} names")
    return names


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"host name must be a non-empty str, got {name!r}")
    bad = _FORBIDDEN_IN_NAME.intersection(name)
    if bad:
        raise ValueError(f"host name {name!r} contains {''.join(sorted(bad))!r}")


def _format_runs(numbers: list[tuple[int, str]]) -> str:
    """Comma list of ranges for (value, digits) pairs already known to chain."""
    pieces = []
    run_start = 0
    for i in range(1, len(numbers) + 1):
        if i < len(numbers) and _continues(numbers[i - 1], numbers[i], numbers[run_start][1]):
            continue
        first, last = numbers[run_start][1], numbers[i - 1][1]
        pieces.append(first if run_start == i - 1 else f"{first}-{last}")
        run_start = i
    return ",".join(pieces)


def _continues(prev: tuple[int, str], cur: tuple[int, str], run_first: str) -> bool:
    """Whether ``cur`` extends a range that starts at ``run_first`` and ends at ``prev``."""
    return cur[0] == prev[0] + 1 and str(cur[0]).zfill(len(run_first)) == cur[1]


def compress_nodelist(names: Iterable[str]) -> str:
    """Write host names as a compact SLURM node list, keeping their order.

    Adjacent names that share a prefix and end in digits go into one bracket
    group, ascending runs into ``LO-HI`` ranges; so ``expand_nodelist`` gives
    back exactly ``names`` (order and duplicates included). Sort the names first
    for the most compact form. Raises ``ValueError`` for an empty name or one
    containing brackets, commas or whitespace.
    """
    groups: list[tuple[str, list[tuple[int, str]]]] = []  # (prefix, [(value, digits)])
    for name in names:
        _check_name(name)
        match = _TRAILING_DIGITS.match(name)
        if not match:
            groups.append((name, []))
            continue
        prefix, digits = match.group(1), match.group(2)
        if groups and groups[-1][1] and groups[-1][0] == prefix:
            groups[-1][1].append((int(digits), digits))
        else:
            groups.append((prefix, [(int(digits), digits)]))
    items = []
    for prefix, numbers in groups:
        if not numbers:
            items.append(prefix)
        elif len(numbers) == 1:
            items.append(prefix + numbers[0][1])
        else:
            items.append(f"{prefix}[{_format_runs(numbers)}]")
    return ",".join(items)
