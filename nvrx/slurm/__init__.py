"""SLURM side of nvrx: node lists, the job's topology, and client commands.

Importing this package starts no process and imports no torch.
"""

from nvrx.slurm.nodelist import compress_nodelist, expand_nodelist
from nvrx.slurm.topology import Topology, ports_for_job

__all__ = ["Topology", "compress_nodelist", "expand_nodelist", "ports_for_job"]
