"""Submission: ``nvrx.submit`` and ``Executor`` through submitit, one supervisor per node.

The top layer: it starts supervisors and reads reports, and nothing below imports it.
"""
