"""The nvrx store: client/server helpers, barriers, rounds and fault records.

Nothing here knows the Wrapper or the supervisor; every function takes an
object with torch's ``Store`` API. Importing this package does not import torch.
"""

# The barrier functions stay in ``nvrx.store.barrier`` (``barrier.barrier``,
# ``barrier.arrive``, ``barrier.wait``): a package-level ``barrier`` function
# would hide the submodule of the same name.
from .barrier import BarrierError, BarrierOverflow, BarrierTimeout
from .client import connect, delete_prefix, external_store_address, serve
from .faults import FaultRecord, append_record, exception_signature, from_exception, read_records
from .rounds import (
    GENERATION_STEP,
    count_job_restart,
    current_round,
    generation_base,
    job_restarts,
    publish_round,
)

__all__ = [
    "GENERATION_STEP",
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "FaultRecord",
    "append_record",
    "connect",
    "count_job_restart",
    "current_round",
    "delete_prefix",
    "exception_signature",
    "external_store_address",
    "from_exception",
    "generation_base",
    "job_restarts",
    "publish_round",
    "read_records",
    "serve",
]
