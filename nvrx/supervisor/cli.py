"""``nvrx-supervise``: run one node of a fault-tolerant training job.

Usage: ``nvrx-supervise [options] -- COMMAND ARGS...`` (one per node, e.g. via
``nvrx-srun``). Exit codes are listed in ``docs/supervisor.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from nvrx import jobenv, processes
from nvrx.help_format import HelpFormatter
from nvrx.jobenv import DEFAULT_LOG_DIR, DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, JobEnv
from nvrx.straggler import StragglerRule
from nvrx.version import __version__

from . import free_ports, ft_options, nproc, preemption, rank_logs, torchrun
from .config import (
    DEFAULT_FINISH_TIMEOUT_S,
    DEFAULT_GRACE_PERIOD_S,
    DEFAULT_LOOP_BREAKER,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_NODE_HEARTBEAT_S,
    DEFAULT_NODE_TIMEOUT_S,
    DEFAULT_STANDBY_WAIT_S,
    DEFAULT_STORE_TIMEOUT_S,
    STRAGGLER_ACTIONS,
    ConfigError,
    SupervisorConfig,
    in_slurm_step,
    job_from_slurm,
    not_in_a_batch_shell,
)
from .exit_codes import ExitCode, exit_code_help

PROG = "nvrx-supervise"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2 (ExitCode.USAGE)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see {PROG} --help)")


def _new_parser() -> _Parser:
    return _Parser(
        prog=PROG,
        usage=f"{PROG} [options] -- COMMAND [ARGS...]",
        description=(
            "Supervise the training processes of one node: start the job's store (node 0), "
            "start --nproc-per-node children with RANK/WORLD_SIZE/... set, restart a child that "
            "fails, and stop all children of all nodes when one stops the job (exit 130, RestartAbort) "
            "or the job cannot go on. Under srun the topology comes from SLURM; otherwise give "
            "--nnodes/--node-rank/--master-addr/--master-port to run several local supervisors as one job."
        ),
        epilog="As with torchrun, an option not given falls back to $PET_<OPTION> for "
        + ", ".join("--" + d.replace("_", "-") for d in torchrun.OPTIONS)
        + " (e.g. $PET_NPROC_PER_NODE); under srun the topology ones are ignored: SLURM gives "
        "the topology.\n\n" + exit_code_help(),
        allow_abbrev=False,  # with two spellings per option, abbreviations would be ambiguous
        formatter_class=HelpFormatter,  # the epilog's lines stay, filled each
    )


#: Adds an option under its dashed name and torchrun's underscore spelling.
Add = Callable[..., None]


def _adder(parser: argparse.ArgumentParser) -> Add:
    def add(*names: str, **kwargs: object) -> None:
        """An option under its dashed name and torchrun's underscore spelling."""
        aliases = ["--" + n[2:].replace("-", "_") for n in names if n.startswith("--")]
        parser.add_argument(*names, *(a for a in aliases if a not in names), **kwargs)  # type: ignore[arg-type]

    return add


def build_parser() -> argparse.ArgumentParser:
    """The options of ``nvrx-supervise``, by group, then the training command."""
    parser = _new_parser()
    add = _adder(parser)
    add("--version", action="version", version=f"{PROG} {__version__}")
    _add_topology(add)
    _add_ports(add)
    _add_job_files(add)
    _add_restarts(add)
    _add_nodes(add)
    _add_output(add)
    _add_stragglers(add)
    ft_options.add_options(add)
    torchrun.add_answers(add)
    add("--verbose", "-v", action="store_true", help="log each decision to stderr")
    add("command", nargs=argparse.REMAINDER, help="the training command, after '--'")
    return parser


def _add_topology(add: Add) -> None:
    """How many processes on how many nodes, and where node 0 is."""
    add(
        "--nproc-per-node",
        default="1",
        metavar="N|auto|cpu|gpu",
        help="training processes on this node: a number, or as torchrun counts them: 'gpu' "
        "(GPUs visible: $CUDA_VISIBLE_DEVICES, else the NVIDIA driver's), 'cpu' (CPUs this "
        "process may use), 'auto' (GPUs if any, else CPUs) (default 1)",
    )
    add(
        "--nnodes",
        type=torchrun.node_count,
        default=None,
        metavar="N",
        help="nodes in the job (default: SLURM, else 1; under srun, giving --nnodes, --node-rank "
        "or --master-addr takes all three from the command line, not from SLURM, those not given "
        f"being 1, 0 and {DEFAULT_MASTER_ADDR})",
    )
    add(
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="this node's rank 0..nnodes-1 (default: SLURM, else 0)",
    )
    add(
        "--master-addr",
        default=None,
        metavar="HOST",
        help=f"host of node 0; the store runs there (default: first SLURM node, else {DEFAULT_MASTER_ADDR})",
    )


def _add_ports(add: Add) -> None:
    """torch's rendezvous port and the job's store port."""
    add(
        "--master-port",
        type=int,
        default=None,
        metavar="PORT",
        help="port for torch's own rendezvous, passed to children as MASTER_PORT (default: "
        "under SLURM $MASTER_PORT, else one derived from SLURM's job id; elsewhere a job of one node without --store-port takes a "
        f"free pair and says which; else {DEFAULT_MASTER_PORT})",
    )
    add(
        "--store-port",
        type=int,
        default=None,
        metavar="PORT",
        help="port of the job's store on node 0 (default: under SLURM $NVRX_STORE_PORT if set; else the "
        "master port + 3, past the +1 and +2 that scripts in NVRx's layout take for their own stores; - 3 "
        "where + 3 would pass 65535)",
    )


def _add_job_files(add: Add) -> None:
    """The job's id and where its events and logs go."""
    add(
        "--job-id",
        default=None,
        metavar="ID",
        help=f"job id for events and logs (default: ${jobenv.JOB_ID}, $SLURM_JOB_ID, else local-<store port>)",
    )
    add(
        "--log-dir",
        default=None,
        metavar="DIR",
        help=f"base log directory; events go to DIR/<job id>/ (default: ${jobenv.LOG_DIR}, else ./{DEFAULT_LOG_DIR})",
    )


def _add_restarts(add: Add) -> None:
    """The restart budget, the loop breaker and the time limits of stops and waits."""
    add(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        metavar="N",
        help=f"process restarts allowed for the whole job, counted in the store (default {DEFAULT_MAX_RESTARTS})",
    )
    add(
        "--loop-breaker",
        type=int,
        default=DEFAULT_LOOP_BREAKER,
        metavar="K",
        help=f"stop the job when a local rank fails with the same signature K times in a row (a "
        "job-wide restart's: when the job does, whichever rank fails first); 0 disables "
        f"(default {DEFAULT_LOOP_BREAKER})",
    )
    add(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD_S,
        metavar="S",
        help=f"seconds children get after SIGTERM before their process groups are killed (default {DEFAULT_GRACE_PERIOD_S:g}; "
        "at the end of SLURM's warning window they get 5 s, at a store failover 1 s); keep it "
        "below SLURM's KillWait",
    )
    add(
        "--store-timeout",
        type=float,
        default=DEFAULT_STORE_TIMEOUT_S,
        metavar="S",
        help=f"seconds to start or reach the store, and to wait for one store answer (default {DEFAULT_STORE_TIMEOUT_S:g})",
    )
    add(
        "--finish-timeout",
        type=float,
        default=DEFAULT_FINISH_TIMEOUT_S,
        metavar="S",
        help=f"seconds node 0 keeps the store up for other nodes after its own children ended (default {DEFAULT_FINISH_TIMEOUT_S:g})",
    )


def _add_nodes(add: Add) -> None:
    """Spare nodes, warm standbys, shrinking, and how a lost node is found."""
    add(
        "--spare-nodes",
        type=int,
        default=None,
        metavar="K",
        help="of the job's --nnodes supervisors (under SLURM: its nodes), the last K start as "
        "spares: their supervisor runs and watches the store, with no training ranks; when a "
        "node is lost, the lowest free spare takes "
        "its node rank and its children rejoin the running job; when the lost node hosted the "
        "store, a majority of the slots elects the next one and every rank starts again (default: "
        "$NVRX_SPARE_NODES, else 0)",
    )
    add(
        "--warm-standby",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start processes ahead, torch imported: on each training node, one for its next "
        "restart of any local rank, once its children train (see --standby-wait; cold after 3 "
        "die unused); on a spare, one per local rank (run when it takes over a node); during a "
        "store failover, one per local rank; with 3 --nnodes or more, a node agent (and on the "
        "node next in line, a store) ready for a failover. Only for 'python script.py ...' or "
        "'python -m module ...'. On by default; --no-warm-standby ($NVRX_WARM_STANDBY=0): all cold",
    )
    add(
        "--standby-wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a node's standby for restarts starts once its children train (a Wrapper rank in "
        "its round, a fault-tolerance client connected); for a script that tells neither, this "
        "long after its last child started, about when its imports are done "
        f"(default: $NVRX_STANDBY_WAIT_S, else {DEFAULT_STANDBY_WAIT_S:g})",
    )
    add(
        "--min-nodes",
        type=int,
        default=None,
        metavar="M",
        help="with no spare left, go on after a node loss while at least M training nodes remain "
        "(the lost ranks are removed); below M the job stops with exit 8 (default: all active "
        "nodes, i.e. never shrink; also $NVRX_MIN_NODES)",
    )
    add(
        "--node-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a node whose supervisor sends no heartbeat for S seconds is declared lost "
        f"(default: $NVRX_NODE_TIMEOUT_S, else {DEFAULT_NODE_TIMEOUT_S:g}; at least twice "
        "--node-heartbeat)",
    )
    add(
        "--node-heartbeat",
        type=float,
        default=DEFAULT_NODE_HEARTBEAT_S,
        metavar="S",
        help=f"seconds between node heartbeats in the store (default {DEFAULT_NODE_HEARTBEAT_S:g})",
    )


def _add_stragglers(add: Add) -> None:
    """Which step times name slow ranks and nodes, and what is done about a slow node."""
    add(
        "--straggler-action", choices=STRAGGLER_ACTIONS, default="report",
        help="a node whose ranks' step times (from RankMonitorClient.record_step or "
        "--straggler-section) stay slower than the job's fast ranks is named in a 'straggler' "
        "event and in nvrx-report (report); exclude also has it leave the job when a spare node "
        "is free, the spare taking its place (never the node hosting the store) (default report)",
    )  # fmt: skip
    add(
        "--straggler-section", default=None, metavar="NAME",
        help="take the durations of the fault-tolerance section NAME as the ranks' step times "
        "(a section around the step's own work, not its wait in collectives; default: only "
        "what ranks pass to record_step)",
    )  # fmt: skip
    add(
        "--straggler-threshold", type=float, default=StragglerRule.threshold, metavar="SCORE",
        help="a rank (or node) is named when its score, the job's fast ranks' step time over "
        f"its own, stays below SCORE (default {StragglerRule.threshold:g}: 25 %% slower)",
    )  # fmt: skip


def _add_output(add: Add) -> None:
    """Where each rank's output goes, as torchrun's options say."""
    streams = "0 none, 1 stdout, 2 stderr, 3 both; or per local rank, e.g. 0:3,1:2"
    add(
        "--redirects", "-r", default="0", metavar="STD",
        help=f"as torchrun: write these streams of each rank only to stdout.log/stderr.log in "
        f"its directory <log dir>/<job id>/ranks/rank<R>/attempt<A>-.../ ({streams}; default 0)",
    )  # fmt: skip
    add(
        "--tee", "-t", default="0", metavar="STD",
        help="as torchrun: write these streams to the rank's files and to this console, each "
        f"line prefixed [default<local rank>]: (${rank_logs.PREFIX_TEMPLATE_ENV} changes it) "
        f"({streams}; default 0)",
    )  # fmt: skip
    add(
        "--local-ranks-filter", default="", metavar="L,...",
        help="as torchrun: only these local ranks' output reaches this console; the files of "
        "--redirects/--tee are written for every rank (default: all)",
    )  # fmt: skip


def _resolve_command(command: list[str], on_node: bool = True) -> list[str]:
    """The training command after ``--``; checked to be there only ``on_node`` (another host's
    file system and PATH tell nothing of the node's)."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError(
            f"no training command: put it after '--', e.g. {PROG} --nproc-per-node 2 -- python train.py"
        )
    if not on_node:
        return command
    exe = command[0]
    if os.sep in exe:
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise ConfigError(
                f"training command {exe!r} is not an executable file: fix the path after '--'"
            )
    elif shutil.which(exe) is None:
        raise ConfigError(f"training command {exe!r} not found on PATH: fix the command after '--'")
    return command


def _parse(argv: Sequence[str], env: Mapping[str, str]) -> tuple[argparse.Namespace, list[str]]:
    """The options parsed, torchrun's ``$PET_*`` standing in for those not given; and the
    part of ``argv`` before the training command, where they were looked for."""
    parser = build_parser()
    options = _options_part(parser, argv)
    parser.set_defaults(**torchrun.fallbacks(env, options))
    return parser.parse_args(list(argv)), options


def _options_part(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The arguments of ``argv`` before the training command, which is taken as given from
    its first word on (with or without ``--``), whatever options of its own it has."""
    command = parser.parse_args(list(argv)).command
    return list(argv)[: len(argv) - len(command)]


def config_from_args(
    argv: Sequence[str], env: Mapping[str, str] | None = None, count_here: bool = True
) -> tuple[SupervisorConfig, bool]:
    """Parse ``argv`` (without the program name) into (config, verbose); ``ConfigError`` on bad input.

    ``count_here`` False: the options are checked from another host than the node's (``nvrx-srun``
    before it starts the supervisors): ``--nproc-per-node auto|cpu|gpu`` is not counted here
    (each node counts its own), it stands for 1; the command is not looked for here either."""
    env = os.environ if env is None else env
    args, options = _parse(argv, env)
    _no_empty_values(args, options)
    try:
        processes.warning_signal(env)
        preemption.settings_from_env(env)  # else each node's supervisor fails as it starts
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    command = _resolve_command(list(args.command), on_node=count_here)
    args.nproc_per_node = _nproc(str(args.nproc_per_node), options, env, count_here)
    picked = False
    local_topology = any(v is not None for v in (args.nnodes, args.node_rank, args.master_addr))
    if in_slurm_step(env) and not local_topology:
        job = job_from_slurm(
            env, args.nproc_per_node, args.log_dir, args.master_port, args.store_port
        )
        not_in_a_batch_shell(
            env, job.nnodes, "nodes", "start one supervisor per node with "
            "`nvrx-srun [options] -- COMMAND` (or `srun --ntasks-per-node=1 nvrx-supervise ...`)"
        )
        if args.job_id:
            job = replace(job, job_id=args.job_id)
    else:
        job, picked = _local_job(args, env)
        _outside_the_allocation(env, local_topology)
    config = SupervisorConfig(
        command=command,
        job=job,
        max_restarts=args.max_restarts,
        loop_breaker=args.loop_breaker,
        grace_period=args.grace_period,
        store_timeout=args.store_timeout,
        finish_timeout=args.finish_timeout,
        **_node_settings(args, env),
        node_heartbeat=args.node_heartbeat,
        rank_logs=_rank_logs(args, options, env),
        ft=ft_options.config_from(args),
        ft_restart_policy=args.ft_restart_policy,
        non_retryable_patterns=ft_options.non_retryable_patterns(args),
        straggler_action=args.straggler_action,
        straggler_section=args.straggler_section,
        straggler_threshold=args.straggler_threshold,
    )
    if picked:
        print(
            f"{PROG}: no --master-port given; using free ports {config.master_port} (ranks' "
            f"MASTER_PORT) and {config.store_port} (nvrx store)",
            file=sys.stderr,
        )
    return config, args.verbose


def _outside_the_allocation(env: Mapping[str, str], local_topology: bool) -> None:
    """Say so when this shell holds a SLURM allocation (``salloc``) that srun did not start
    this supervisor in, and no topology was given: it trains here, on the host of the shell,
    not on the allocated nodes."""
    if "SLURM_JOB_ID" not in env or local_topology:
        return
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "?"
    print(
        f"{PROG}: warning: this shell holds SLURM job {env['SLURM_JOB_ID']}'s allocation of "
        f"{nodes} node(s), but srun did not start this supervisor: it runs one node here, on "
        f"{socket.gethostname()}; to run one per allocated node: nvrx-srun [options] -- COMMAND",
        file=sys.stderr,
    )


def _nproc(asked: str, argv: Sequence[str], env: Mapping[str, str], count_here: bool) -> int:
    """``--nproc-per-node``: a number, or a keyword counted on this node (and said), or, not
    ``count_here``, 1 for a keyword; ``ConfigError`` naming $PET_NPROC_PER_NODE where it came from."""
    if asked in nproc.KEYWORDS and not count_here:
        return 1
    try:
        count = nproc.resolve(asked, env)
    except ValueError as exc:
        source = "" if torchrun.given(argv, "nproc_per_node") else " (from $PET_NPROC_PER_NODE)"
        raise ConfigError(f"{exc}{source}") from exc
    if asked in nproc.KEYWORDS:
        print(f"{PROG}: --nproc-per-node {asked}: {count}", file=sys.stderr)
    return count


#: Options (argparse names) whose empty value would silently stand for their default: a
#: name, an address, a folder, a file, a setting.
NOT_EMPTY = (
    "master_addr", "job_id", "log_dir", "straggler_section",
    *(f"ft_{name}" for name in ("cfg_path", "non_retryable_exception_file", *ft_options.SETTINGS)),
)  # fmt: skip


def _no_empty_values(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """ConfigError naming an option of ``NOT_EMPTY`` given an empty value (``--job-id ''``),
    or the ``$PET_*`` variable that gave it one."""
    for dest in NOT_EMPTY:
        if getattr(args, dest) != "":
            continue
        option = "--" + dest.replace("_", "-")
        if dest in torchrun.OPTIONS and not torchrun.given(argv, dest):
            raise ConfigError(f"$PET_{dest.upper()} (for {option}) is empty: set a value or unset it")
        raise ConfigError(f"{option} must not be empty: give a value or leave the option out")


def _local_job(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[JobEnv, bool]:
    """The job of the options, not SLURM's, and whether its ports were picked free: a job of
    one node given no port takes a free pair (``free_ports``), so that a second such job
    beside it does not fail on taken ports; jobs of several nodes keep the defaults, which
    every node computes alike."""
    nnodes = args.nnodes if args.nnodes is not None else 1
    pair = None
    if nnodes == 1 and args.master_port is None and args.store_port is None:
        pair = free_ports.free_pair(args.master_addr or DEFAULT_MASTER_ADDR)
    master_port, store_port = pair or (args.master_port, args.store_port)
    job = JobEnv.local(
        nnodes=nnodes,
        node_rank=args.node_rank if args.node_rank is not None else 0,
        nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr,
        master_port=master_port,
        store_port=store_port,
        job_id=args.job_id,
        log_dir=args.log_dir,
        env=env,
    )
    return job, pair is not None


def _rank_logs(
    args: argparse.Namespace, argv: Sequence[str], env: Mapping[str, str]
) -> rank_logs.RankLogs:
    """--redirects, --tee, --local-ranks-filter; an error names $PET_* when the value came from it."""
    try:
        return rank_logs.RankLogs.from_options(
            args.redirects, args.tee, args.local_ranks_filter, env
        )
    except ValueError as exc:
        taken = [
            f"$PET_{dest.upper()}"
            for dest in ("redirects", "tee", "local_ranks_filter")
            if f"PET_{dest.upper()}" in env and not torchrun.given(argv, dest, torchrun.SHORT.get(dest))
        ]
        source = f" (values from {', '.join(taken)})" if taken else ""
        raise ConfigError(f"{exc}{source}") from exc


def _node_settings(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object]:
    """Spare nodes, minimum nodes, warm standbys and node timeout: the option, else the
    template's variable (``from_env`` names those of the first two taken from one)."""
    try:
        return {
            "spare_nodes": args.spare_nodes
            if args.spare_nodes is not None
            else jobenv.int_from(env, jobenv.SPARE_NODES, 0),
            "min_nodes": args.min_nodes
            if args.min_nodes is not None
            else jobenv.int_from(env, jobenv.MIN_NODES, 0) or None,
            "from_env": {
                name: variable
                for name, variable in (("spare_nodes", jobenv.SPARE_NODES), ("min_nodes", jobenv.MIN_NODES))
                if getattr(args, name) is None and variable in env
            },
            "warm_standby": args.warm_standby
            if args.warm_standby is not None
            else _switch(env, jobenv.WARM_STANDBY, True),
            "node_timeout": args.node_timeout
            if args.node_timeout is not None
            else jobenv.seconds_from(env, jobenv.NODE_TIMEOUT_S, DEFAULT_NODE_TIMEOUT_S),
            "standby_wait": args.standby_wait
            if args.standby_wait is not None
            else jobenv.seconds_from(env, jobenv.STANDBY_WAIT_S, DEFAULT_STANDBY_WAIT_S),
        }
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A 0/1 setting from the environment; ValueError naming it for any other value."""
    raw = env.get(name, "")
    if raw in ("", "0", "1"):
        return default if raw == "" else raw == "1"
    raise ValueError(f"${name} must be 0 or 1, got {raw!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (see ``exit_codes``)."""
    from .exit_codes import SupervisorError
    from .supervisor import Supervisor

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config, verbose = config_from_args(argv)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format=f"%(asctime)s {PROG}[n{config.node_rank}] %(levelname)s %(message)s",
    )
    if jobenv.sets_omp_default({**os.environ, **config.extra_env}, config.nproc_per_node):
        print(
            f"{PROG}: OMP_NUM_THREADS is unset: each of the {config.nproc_per_node} ranks of this "
            "node gets OMP_NUM_THREADS=1 (as torchrun does); set it to tune",
            file=sys.stderr,
        )
    try:
        return Supervisor(config).run()
    except SupervisorError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
