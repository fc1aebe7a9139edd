"""torchrun's ``$PET_<OPTION>`` variables: defaults for the ``nvrx-supervise`` options not given.

torchrun reads every option it is not given from ``PET_<OPTION>``; nvrx does so for
the options the two share. Under srun the topology ones are ignored: SLURM gives
the topology.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .config import ConfigError, in_slurm_step

#: Options (argparse names) that fall back to ``$PET_<OPTION>`` (e.g. ``PET_NPROC_PER_NODE``).
OPTIONS = (
    "nproc_per_node", "max_restarts", "nnodes", "node_rank", "master_addr", "master_port",
    "redirects", "tee", "local_ranks_filter",
)  # fmt: skip
TOPOLOGY = ("nnodes", "node_rank", "master_addr", "master_port")
_INTEGER = ("max_restarts", "nnodes", "node_rank", "master_port")


def fallbacks(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's ``$PET_<OPTION>`` values, as defaults for the options not given."""
    found = {}
    for dest in OPTIONS:
        name = f"PET_{dest.upper()}"
        if name not in env or (dest in TOPOLOGY and in_slurm_step(env)):
            continue
        value = env[name]
        if dest in _INTEGER and not value.strip().isdigit():
            option = "--" + dest.replace("_", "-")
            raise ConfigError(f"${name} (for {option}) must be a whole number, got {value!r}")
        found[dest] = value
    return found


def given(argv: Sequence[str], dest: str, short: str | None = None) -> bool:
    """Whether the option ``dest`` (or its ``short`` form) is on the command line, before the
    training command."""
    head = list(argv)[: list(argv).index("--")] if "--" in argv else list(argv)
    spellings = ("--" + dest.replace("_", "-"), "--" + dest, *([short] if short else []))
    return any(a in spellings or a.startswith(tuple(s + "=" for s in spellings)) for a in head)
