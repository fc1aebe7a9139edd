"""SLURM side of nvrx: node lists, the job's topology (as ``nvrx.jobenv.JobEnv``), and client commands.

Importing this package starts no process and imports no torch.
"""

from nvrx.slurm.nodelist import compress_nodelist, expand_nodelist
from nvrx.slurm.topology import job_from_slurm, ports_for_job

__all__ = ["compress_nodelist", "expand_nodelist", "job_from_slurm", "ports_for_job"]
