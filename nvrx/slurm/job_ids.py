"""Which SLURM job this process runs in, as the supervisor records it in ``supervisor_start``.

``SLURM_JOB_ID`` is the id ``sacct`` (its ``JobIDRaw``), ``scontrol`` and ``scancel`` take.
An element of a job array has an id of its own there, while SLURM names its default output
file after the array's id and the element's index (``slurm-%A_%a.out``, and submitit its
logs ``%A_%a_<task>_log.out``): only ``SLURM_ARRAY_JOB_ID`` and ``SLURM_ARRAY_TASK_ID`` tell
them, so they are recorded beside it for the report to find those files.
"""

from __future__ import annotations

from collections.abc import Mapping


def slurm_job_ids(env: Mapping[str, str]) -> dict[str, str | None]:
    """The ``supervisor_start`` fields that name the SLURM job of ``env`` (None outside SLURM,
    and the array's two outside a job array)."""
    return {
        "slurm_job_id": env.get("SLURM_JOB_ID") or None,
        "slurm_array_job_id": env.get("SLURM_ARRAY_JOB_ID") or None,
        "slurm_array_task_id": env.get("SLURM_ARRAY_TASK_ID") or None,
    }


def array_task_name(array_job_id: object, array_task_id: object) -> str | None:
    """``<array id>_<index>`` (SLURM's ``%A_%a``) of a job array's element, from the
    ``supervisor_start`` fields; None when either is not recorded."""
    if isinstance(array_job_id, str) and isinstance(array_task_id, str):
        if array_job_id and array_task_id:
            return f"{array_job_id}_{array_task_id}"
    return None
