"""What the Wrapper knows of an nvrx supervisor: whether one runs this process, and whether it restarted it.

Under a supervisor a ``RestartAbort`` ends the process with exit code 130, and
a process the supervisor restarted asks the running job to take it back
(``rejoin``) before it starts a new process generation.
"""

from __future__ import annotations

from nvrx import jobenv
from nvrx.store import client as store_client


def supervised() -> bool:
    """Whether an nvrx supervisor runs this process (``NVRX_SUPERVISED=1`` or an external store)."""
    return (
        jobenv.flag_in(None, jobenv.SUPERVISED) or store_client.external_store_address() is not None
    )


def restarted_process() -> bool:
    """Whether this process replaces an earlier one in a running job (``NVRX_RESTART_COUNT``
    > 0), not one of a job that starts anew after a store failover (``NVRX_FRESH_START``)."""
    return jobenv.int_from(None, jobenv.RESTART_COUNT, 0) > 0 and not jobenv.flag_in(
        None, jobenv.FRESH_START
    )
