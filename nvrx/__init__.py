"""nvrx: SLURM-native fault tolerance for distributed PyTorch training.

Importing ``nvrx`` imports no torch, so that ``nvrx.fork_and_monitor()`` can run
at the top of a script before any torch state exists in the process.
"""

from .version import __version__ as __version__


def __getattr__(name: str) -> object:
    # Lazy, so that `import nvrx` stays light; nvrx.supervisor imports no torch either.
    if name == "fork_and_monitor":
        from nvrx.supervisor.fork_and_monitor import fork_and_monitor

        return fork_and_monitor
    if name in ("submit", "Executor"):  # imports submitit only when asked for
        from nvrx.submission import submit as _submit

        return getattr(_submit, name)
    if name in ("preemption_requested", "preemption_info", "record_checkpoint"):
        from nvrx import checkpoint_flag

        return getattr(checkpoint_flag, name)
    raise AttributeError(f"module 'nvrx' has no attribute {name!r}")
