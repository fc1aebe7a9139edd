"""``nvrx-srun``: start one nvrx supervisor per node of the current SLURM allocation.

Usage: ``nvrx-srun [SUPERVISOR OPTIONS] -- COMMAND [ARGS...]``, from an sbatch
script or an salloc shell. It becomes ``srun`` with the options that one
supervisor per node needs, running ``nvrx-supervise`` with the Python that runs
this command (so an installed nvrx works from any virtual environment). First it
has that Python check the supervisor's options and command as node 0's supervisor
will see them (``python -m nvrx.supervisor.check_args``, a program of its own: this
layer knows the supervisor by its command line only): a mistake ends here, in one
line, not in one error per node once the job step has started.

SLURM's warning signal that comes meanwhile (the templates forward it to this process) is
noted, not fatal, from ``main``'s first line on, and the supervisors act on it as if it had
reached them (``nvrx.slurm.early_warning``, which also says what is still not kept: a warning
before ``main`` runs, one in the instant of the exec, and one that srun gets before its tasks
run).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from nvrx import jobenv
from nvrx.slurm.early_warning import EarlyWarning
from nvrx.slurm.nodelist import expand_nodelist
from nvrx.slurm.srun_export import ExportError, with_names_exported
from nvrx.store.seal import new_secret
from nvrx.version import __version__

PROG = "nvrx-srun"
#: srun options, each with why it is there.
SRUN_OPTIONS = (
    # each node gets exactly one supervisor (its node rank is SLURM_PROCID)
    "--ntasks-per-node=1",
    # a supervisor that exits non-zero does not make srun kill the others
    "--kill-on-bad-exit=0",
    # a failed node does not end the step on the other nodes (SLURM 22.05 SIGKILLs every
    # task of the step once it marks the node DOWN); the supervisors notice within seconds
    "--no-kill",
    # the supervisors' lines reach the job's output as they are written
    "--unbuffered",
)
USAGE = f"""usage: {PROG} [SUPERVISOR OPTIONS] -- COMMAND [ARGS...]

Start one nvrx supervisor per node of this SLURM allocation (run it from an sbatch
script or an salloc shell). It checks the SUPERVISOR OPTIONS and COMMAND as node 0's
supervisor would take them under srun (a mistake: exit 2 with the supervisor's message,
before srun), then runs

  srun --nodes=N --ntasks=N {" ".join(SRUN_OPTIONS[:2])} \\
       {" ".join(SRUN_OPTIONS[2:])} $NVRX_SRUN_ARGS \\
       {{python}} -m nvrx.supervisor [SUPERVISOR OPTIONS] -- COMMAND [ARGS...]

with N the allocation's nodes and {{python}} the interpreter of this nvrx. A node that
fails ends neither the step nor the other supervisors (--no-kill, --kill-on-bad-exit=0):
they notice the loss and go on (submit with sbatch --no-kill too, or SLURM ends the
job). scancel's signals reach every supervisor, which passes them to its training
processes and reaps them; SLURM's time-limit or preemption warning ($NVRX_PREEMPT_SIGNAL,
default USR2) has it raise the checkpoint flag instead (docs/submit.md), also when it
reached {PROG} before srun ran ($NVRX_WARNED_AT passes it on).

SUPERVISOR OPTIONS: nvrx-supervise --help.
More srun options: NVRX_SRUN_ARGS (e.g. "--cpu-bind=none"). An --export there, or
SLURM_EXPORT_ENV (sbatch --export=NONE sets it), that does not pass the whole
environment gets the names of the NVRX_* variables added (NONE becomes that list),
so that the supervisors still get them.
"""


NO_COMMAND = (
    f"no training command: put it after '--', e.g. {PROG} --nproc-per-node 2 -- python train.py"
)


class UsageError(Exception):
    """Bad use of nvrx-srun; the message says what to fix."""


def srun_command(
    argv: Sequence[str], env: Mapping[str, str], python: str = sys.executable
) -> list[str]:
    """The srun command line for ``argv`` (supervisor options, ``--``, the training command)."""
    if not env.get("SLURM_JOB_ID"):
        raise UsageError(
            "not inside a SLURM allocation (no SLURM_JOB_ID): run it from sbatch or salloc"
        )
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise UsageError(NO_COMMAND)
    nodes = node_count(env)
    try:
        extra = shlex.split(env.get(jobenv.SRUN_ARGS, ""))
    except ValueError as exc:
        raise UsageError(f"{jobenv.SRUN_ARGS} cannot be split into options: {exc}") from None
    try:
        extra = with_names_exported(extra, env)
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    srun = shutil.which("srun", path=env.get("PATH"))
    if srun is None:
        raise UsageError("srun not found on PATH: nvrx-srun needs SLURM's client commands")
    return [
        srun, f"--nodes={nodes}", f"--ntasks={nodes}", *SRUN_OPTIONS, *extra,
        python, "-m", "nvrx.supervisor", *argv,
    ]  # fmt: skip


def node_count(env: Mapping[str, str]) -> str:
    """The allocation's nodes, one supervisor each; ``UsageError`` for a value that is none."""
    name = "SLURM_JOB_NUM_NODES" if env.get("SLURM_JOB_NUM_NODES") else "SLURM_NNODES"
    nodes = env.get(name) or "1"
    if not nodes.isdigit() or int(nodes) < 1:
        raise UsageError(f"{name} must be a number of nodes, got {nodes!r}")
    return nodes


def step_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as node 0's supervisor sees it under the srun of ``srun_command``: the task of
    rank 0 of a step of one task on each of the allocation's nodes. Where the allocation's
    node list is missing or short, stand-in names fill it (the check needs none of them)."""
    nodes = int(node_count(env))
    try:
        hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    except ValueError:
        hosts = []
    if len(hosts) < nodes:
        hosts = [f"node{i}" for i in range(nodes)]
    step = {k: v for k, v in env.items() if not k.startswith("SLURM_STEP_")}
    step.update(
        SLURM_STEP_ID="0", SLURM_STEP_NODELIST=",".join(hosts[:nodes]),
        SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NUM_TASKS=str(nodes), SLURM_NTASKS=str(nodes),
        SLURM_PROCID="0", SLURM_NODEID="0", SLURM_LOCALID="0",
    )  # fmt: skip
    return step


#: How long ``nvrx-srun`` waits for its check of the supervisor's options (a stalled file
#: system, a slow name lookup): past it, srun runs and the supervisors check for good.
CHECK_TIMEOUT_S = 30.0


def check_supervisor(argv: Sequence[str], env: Mapping[str, str], python: str = sys.executable) -> None:
    """``UsageError`` with the supervisor's own message when ``nvrx-supervise`` would refuse
    ``argv`` (its options, the command after ``--``) in ``env`` (``step_env``), as every node's
    supervisor would, after the allocation was granted."""
    check = [python, "-m", "nvrx.supervisor.check_args", *argv]
    try:
        done = subprocess.run(
            check, env=dict(env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=CHECK_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"{PROG}: warning: could not check the supervisor's options ({exc}); "
              "the supervisors will", file=sys.stderr)  # fmt: skip
        return
    said = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2 and said:
        raise UsageError(said[-1])
    if done.returncode != 0:  # the check itself failed: the supervisors still check for good
        print(f"{PROG}: warning: could not check the supervisor's options ({' '.join(check[:3])} "
              f"exited {done.returncode}: {said[-1] if said else 'no message'}); the supervisors "
              "will", file=sys.stderr)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: becomes srun (exec); returns only on a usage error (exit 2).
    SLURM's warning until then is kept and passed on to the supervisors (``early_warning``)."""
    warning = EarlyWarning.install(os.environ)  # first: the check below takes a while
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # as argparse answers a missing argument: the usage line, then what is missing
        print(USAGE.splitlines()[0], file=sys.stderr)
        print(f"{PROG}: error: {NO_COMMAND} (see {PROG} --help)", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if argv[0] == "--version":
        print(f"{PROG} {__version__}")
        return 0
    try:
        command = srun_command(argv, os.environ)
        check_supervisor(argv, step_env(os.environ))
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    # One secret for the job step's supervisors (nvrx.store.seal): srun passes it to each.
    os.environ.setdefault(jobenv.JOB_SECRET, new_secret())
    sys.stdout.flush()
    warning.pass_on(os.environ)  # last: the signal stays blocked through the exec
    os.execv(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
