"""nvrx: SLURM-native fault tolerance for distributed PyTorch training.

Importing ``nvrx`` imports no torch, so that ``nvrx.fork_and_monitor()`` can run
at the top of a script before any torch state exists in the process.
"""

__version__ = "0.1.0"
