"""Submission: ``nvrx.submit`` and ``Executor`` through submitit, one supervisor per node.

The top layer: it starts supervisors and reads reports, and nothing below imports it.
submitit is an optional dependency (the ``submit`` extra): without it, importing this
package (and so using ``nvrx.submit`` or ``nvrx.Executor``) raises ModuleNotFoundError
saying how to install it, while the rest of nvrx works.
"""

#: What to do when submitit is missing.
MISSING_SUBMITIT = "nvrx.submit needs submitit: pip install 'nvrx[submit]'"

try:
    import submitit as _submitit  # noqa: F401 - checked here, before any module that uses it
except ModuleNotFoundError as exc:
    if exc.name != "submitit":  # submitit is there but broken: its own error says what
        raise
    raise ModuleNotFoundError(MISSING_SUBMITIT, name="submitit") from exc
