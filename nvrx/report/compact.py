"""Compact lists for the report's tables: rank ranges (``0-2,5``) and host lists for ``--exclude=``."""

from __future__ import annotations

from collections.abc import Iterable

from nvrx.slurm.nodelist import compress_nodelist


def compress_ints(values: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (rank lists in tables)."""
    runs: list[list[int]] = []
    for n in sorted(set(values)):
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def exclude_list(hosts: Iterable[str]) -> str:
    """Hosts as one compressed SLURM list (``node[01-03]``), ready for ``sbatch --exclude=``.

    A host name SLURM could not take in a list (brackets, commas) is listed as it is.
    """
    names = sorted(set(hosts))
    try:
        return compress_nodelist(names)
    except ValueError:
        return ",".join(names)
