"""The nvrx store: client/server helpers, barriers, rounds and fault records.

Nothing here knows the Wrapper or the supervisor; every function takes an
object with torch's ``Store`` API. Importing this package does not import torch,
nor any of its modules: each is imported by name (``nvrx.store.rounds``, ...).
"""
