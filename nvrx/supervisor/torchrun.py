"""What a torchrun user brings to ``nvrx-supervise``: its variables and its options.

torchrun reads every option it is not given from ``PET_<OPTION>``; nvrx does so for
the options the two share (``fallbacks``). Under srun the topology ones are ignored:
SLURM gives the topology.

A user coming from torchrun also types the options nvrx does not take, out of habit;
argparse alone would only say "unrecognized arguments". Each one here (``HABITS``) is a
hidden option of the parser whose use stops the parse with one line: why nvrx does not
need it and what to give instead. Only options before the training command are seen:
the command after ``--`` is passed on untouched.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence

from .config import ConfigError, in_slurm_step

#: Options (argparse names) that fall back to ``$PET_<OPTION>`` (e.g. ``PET_NPROC_PER_NODE``).
OPTIONS = (
    "nproc_per_node", "max_restarts", "nnodes", "node_rank", "master_addr", "master_port",
    "redirects", "tee", "local_ranks_filter",
)  # fmt: skip
TOPOLOGY = ("nnodes", "node_rank", "master_addr", "master_port")
_INTEGER = ("max_restarts", "nnodes", "node_rank", "master_port")


#: The options of ``OPTIONS`` that have a short form.
SHORT = {"redirects": "-r", "tee": "-t"}


def fallbacks(env: Mapping[str, str], argv: Sequence[str] = ()) -> dict[str, str]:
    """torchrun's ``$PET_<OPTION>`` values, as defaults for the options not given in
    ``argv`` (as torchrun: a variable of an option given is not read, nor checked)."""
    found = {}
    for dest in OPTIONS:
        name = f"PET_{dest.upper()}"
        if name not in env or (dest in TOPOLOGY and in_slurm_step(env)):
            continue
        if given(argv, dest, SHORT.get(dest)):
            continue
        if dest in _INTEGER:
            _check_whole(name, dest, env[name])
        found[dest] = env[name]
    return found


def _check_whole(name: str, dest: str, value: str) -> None:
    option = "--" + dest.replace("_", "-")
    if dest == "nnodes":
        try:
            node_count(value)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"${name} (for {option}): {exc}") from None
    elif not value.strip().isdigit():
        raise ConfigError(f"${name} (for {option}) must be a whole number, got {value!r}")


def given(argv: Sequence[str], dest: str, short: str | None = None) -> bool:
    """Whether the option ``dest`` (or its ``short`` form, its value attached or not: ``-r3``)
    is on the command line, before the training command."""
    head = list(argv)[: list(argv).index("--")] if "--" in argv else list(argv)
    spellings = ("--" + dest.replace("_", "-"), "--" + dest)
    if any(a in spellings or a.startswith(tuple(s + "=" for s in spellings)) for a in head):
        return True
    return short is not None and any(a.startswith(short) for a in head)


_STORE = (
    "is not needed: node 0's supervisor hosts the job's store (give --master-addr/--master-port "
    "when starting nodes by hand; under SLURM nothing)"
)
_COMMAND = "is not needed: the command after '--' runs as given"

#: (spellings, takes a value, the answer after "<option as typed> ").
HABITS: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("--standalone",), False, "is not needed: a single node is the default (drop it)"),
    (("--rdzv-backend",), True, _STORE),
    (("--rdzv-endpoint",), True, _STORE),
    (("--rdzv-id",), True, _STORE),
    (("--rdzv-conf",), True, _STORE),
    (("-m", "--module"), False, f"{_COMMAND}: write 'python -m MODULE' after '--'"),
    (("--no-python",), False, f"{_COMMAND}: write the executable itself after '--'"),
    (("--run-path",), False, f"{_COMMAND}: write 'python path/to/script.py' after '--'"),
    (
        ("--start-method",),
        True,
        "is not needed: every rank is its own process running the command after '--'",
    ),
    (("--role",), True, "is not needed: every rank has torchrun's one role, 'default' (ROLE_NAME)"),
    (
        ("--term-timeout", "--workers-stop-timeout"),
        True,
        "is --grace-period here: seconds between SIGTERM and SIGKILL of the children",
    ),
    (("--shutdown-timeout",), True, "is --grace-period here: seconds between SIGTERM and SIGKILL"),
    (
        ("--monitor-interval",),
        True,
        "is not needed: the supervisor is woken by each child's exit, it does not poll",
    ),
    (("--local-addr",), True, "is not taken: the ranks reach the store at --master-addr"),
    (
        ("--logs-specs", "--event-log-handler", "--duplicate-stdout-filters",
         "--duplicate-stderr-filters"),
        True,
        "is not taken: ranks' output goes to --log-dir (see --redirects, --tee) and events to "
        "<log dir>/<job>/ as JSON lines",
    ),  # fmt: skip
    (("--numa-binding",), True, "is not taken: bind ranks in the command after '--' (numactl)"),
    (
        ("--signals-to-handle",),
        True,
        "is not taken: the supervisor forwards SIGUSR1/SIGUSR2 and ends the job on SIGTERM/SIGINT",
    ),
    (("--virtual-local-rank",), False, "is not taken: LOCAL_RANK is each rank's own"),
)


class _Answer(argparse.Action):
    """Stops the parse with the habit's answer (``ConfigError``: exit 2, one line)."""

    def __init__(self, option_strings: Sequence[str], dest: str, answer: str, **kwargs: object):
        super().__init__(option_strings, dest, **kwargs)
        self.answer = answer

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:  # fmt: skip
        raise ConfigError(f"{option_string} {self.answer}")


def add_answers(add: Callable[..., None]) -> None:
    """Register each habit with ``add`` (the parser's two-spellings ``add_argument``), hidden from --help."""
    for names, takes_value, answer in HABITS:
        add(*names, action=_Answer, answer=answer, nargs="?" if takes_value else 0,
            dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # fmt: skip


def node_count(text: str) -> int:
    """``--nnodes``: a whole number; torchrun's ``MIN:MAX`` is answered with nvrx's way to it."""
    if ":" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: torchrun's MIN:MAX node range is --nnodes N --spare-nodes K here "
            "(K hot spares among N nodes) and --min-nodes M (go on with M training nodes "
            "when no spare is left)"
        )
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
