"""Abort plug-ins: bring a rank blocked in communication back to Python after a fault.

The Wrapper's monitor thread calls ``abort(frozen_state)`` while the main
thread may be blocked in a collective; only once that call returns can the
restart exception reach the main thread. ``AbortTorchDistributed`` therefore
interrupts gloo (by shutting down its connections, see ``gloo_abort``) and
NCCL (communicator abort), then destroys every process group so that the next
round can initialize new ones.
"""

from __future__ import annotations

import abc
import logging
import os
from pathlib import Path
from typing import Any

from nvrx import jobenv

from . import gloo_abort
from .state import FrozenState

log = logging.getLogger(__name__)

FR_TRACE_PATH_ENV = jobenv.FR_TRACE_PATH
_FR_BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


class Abort(abc.ABC):
    """Base class of ``abort`` plug-ins: ``__call__(FrozenState) -> FrozenState``.

    Called from the Wrapper's monitor thread, not the main thread, while the
    main thread may still run or be blocked in the wrapped function. It must
    return promptly (``AbortTorchDistributed`` waits for a process group creation
    in flight, ``gloo_abort.CREATION_GRACE_S`` at most); its exceptions are logged by
    the Wrapper and ignored.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


def _all_groups() -> list[Any]:
    """Every process group torch knows (the default group and all sub-groups)."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def _nccl_backends(groups: list[Any]) -> list[Any]:
    """The NCCL backends of ``groups``; empty without CUDA or NCCL (never touches a GPU then)."""
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available() or not torch.cuda.is_available():
        return []
    from torch.distributed import ProcessGroupNCCL

    backends = []
    for pg in groups:
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except (RuntimeError, AttributeError):
            continue  # the group has no CUDA backend
        if isinstance(backend, ProcessGroupNCCL):
            backends.append(backend)
    return backends


class AbortTorchDistributed(Abort):
    """Interrupt and destroy all ``torch.distributed`` process groups (gloo and NCCL).

    Steps: let a group creation in flight end (``gloo_abort.await_creations``); dump
    NCCL flight-recorder traces when enabled; shut down the reads of
    the TCP connections of every gloo group (a blocked gloo collective then
    fails in milliseconds instead of at its timeout; peers are not woken, each
    rank must run its own abort); abort NCCL communicators; abort and
    destroy every group and clear torch's group registry, so that
    ``init_process_group`` works again. A no-op when no group exists.

    Only gloo groups created while ``gloo_abort`` tracks group creation have
    known connections: the Wrapper tracks for the length of each call; used
    on its own, create the groups and train inside ``with gloo_abort.tracking():``
    (see docs/abort.md).

    Args:
        torch_fr_trace_path: directory for flight-recorder dumps (one
            ``iter_<iteration>`` sub-directory per round); falls back to
            ``$NVRX_FR_TRACE_PATH``. Dumps are written only when NCCL is present
            and ``TORCH_FR_BUFFER_SIZE``/``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0.
    """

    def __init__(self, torch_fr_trace_path: str | os.PathLike[str] | None = None) -> None:
        self.torch_fr_trace_path = torch_fr_trace_path

    def __call__(self, state: FrozenState) -> FrozenState:
        import torch.distributed as dist

        if not dist.is_available():
            return state
        try:
            if not gloo_abort.await_creations():
                log.warning(
                    "a process group creation still waits after %g s (for a peer that died, "
                    "was restarted or is slow to enter its own): its connections are cut",
                    gloo_abort.CREATION_GRACE_S,
                )  # fmt: skip
            self._abort_groups(state)
        finally:
            gloo_abort.allow_creations()
        return state

    def _abort_groups(self, state: FrozenState) -> None:
        """Shut down the gloo connections, abort NCCL, destroy every group."""
        import torch.distributed as dist

        groups = _all_groups()
        if not groups and not dist.is_initialized() and not gloo_abort.creating():
            self._destroy_all()  # an init cut short before its group existed counted its name
            return
        self.collect_fr_trace(state)
        shut = gloo_abort.shutdown_sockets()
        log.debug("abort: shut down %d gloo connection(s) of %d group(s)", shut, len(groups))
        nccl = _nccl_backends(groups)
        if nccl:
            self._abort_nccl()
        else:
            for pg in groups:
                try:
                    pg.abort()
                except Exception as exc:  # best effort; destroy below still clears the registry
                    log.debug("abort of process group %r failed: %r", pg, exc)
        self._destroy_all()

    @staticmethod
    def _abort_nccl() -> None:
        """Abort all NCCL communicators together; torch then clears its group registry."""
        from torch.distributed import distributed_c10d as c10d

        try:
            c10d._abort_process_group()
        except Exception as exc:
            log.warning("NCCL abort of the process groups failed: %r", exc)

    @staticmethod
    def _destroy_all() -> None:
        """Destroy every remaining group and reset torch's registry (group names restart at 0)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not c10d._world.pg_map:
            # A creation cut short counted a group name: without this, this rank would name
            # the next round's group "1" where a rank that never entered one names it "0".
            c10d._world.group_count = 0
            return
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            else:  # sub-groups without a default group: destroy them one by one
                for pg in list(c10d._world.pg_map):
                    dist.destroy_process_group(pg)
        except Exception as exc:  # a group caught halfway through its creation, say
            log.debug("destroy_process_group failed (%r); clearing the groups instead", exc)
            try:
                AbortTorchDistributed._forget_all_groups()
            except Exception as again:  # torch's private registry changed shape
                log.warning("could not clear torch's process groups: %r (after %r)", again, exc)

    @staticmethod
    def _forget_all_groups() -> None:
        """Shut down every group torch knows and empty its registry, as destroying the
        default group would: for groups that ``destroy_process_group`` cannot take, such as
        one registered by an ``init_process_group`` the abort cut short."""
        from torch.distributed import distributed_c10d as c10d

        world = c10d._world
        for pg in list(world.pg_map):
            try:
                pg.shutdown()
            except Exception as exc:
                log.debug("shutdown of process group %r failed: %r", pg, exc)
        c10d._update_default_pg(None)
        for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                      world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state):  # fmt: skip
            table.clear()
        c10d._unregister_all_process_groups()
        world.group_count = 0

    def collect_fr_trace(self, state: FrozenState) -> Path | None:
        """Write NCCL flight-recorder traces of this rank; returns the file, or None when off."""
        path = self.torch_fr_trace_path or os.environ.get(FR_TRACE_PATH_ENV)
        if not path or not _fr_buffer_enabled():
            return None
        import torch.distributed as dist

        if not dist.is_nccl_available():
            return None
        try:
            import torch

            dump = torch._C._distributed_c10d._dump_nccl_trace()
        except Exception as exc:
            log.warning("could not collect the NCCL flight-recorder trace: %r", exc)
            return None
        target = Path(path) / f"iter_{state.iteration}" / f"rank_{state.initial_rank}"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(dump)
        except OSError as exc:
            log.warning("could not write the flight-recorder trace to %s: %s", target, exc)
            return None
        return target


def _fr_buffer_enabled() -> bool:
    for name in _FR_BUFFER_ENVS:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw) > 0
        except ValueError:
            log.warning("%s must be an integer, got %r: flight-recorder dump skipped", name, raw)
            return False
    return False


class AbortTransformerEngine(Abort):
    """Release Transformer Engine's global state (userbuffers, FP8 state); no-op without TE."""

    def __call__(self, state: FrozenState) -> FrozenState:
        try:
            import transformer_engine.pytorch as te
        except ImportError:
            return state
        destroy_ub = getattr(getattr(te, "module", None), "base", None)
        if destroy_ub is not None and hasattr(destroy_ub, "destroy_ub"):
            destroy_ub.destroy_ub()
        manager = getattr(getattr(te, "fp8", None), "FP8GlobalStateManager", None)
        if manager is not None:
            manager.reset()
        return state


class AbortPersistentCheckpointProcesses(Abort):
    """Abort the persistent worker processes of NVRx's asynchronous checkpointing.

    nvrx has no asynchronous checkpointing of its own: this calls
    ``nvidia_resiliency_ext.checkpointing.async_ckpt.core.abort_nvrx_checkpoint()``
    when that package is installed (a job may use NVRx's checkpointing with
    nvrx's restarts), and does nothing otherwise, since then no such process exists.
    """

    def __call__(self, state: FrozenState) -> FrozenState:
        try:
            from nvidia_resiliency_ext.checkpointing.async_ckpt import core
        except ImportError:
            log.debug("AbortPersistentCheckpointProcesses: NVRx checkpointing not installed")
            return state
        core.abort_nvrx_checkpoint()
        return state


__all__ = [
    "Abort",
    "AbortPersistentCheckpointProcesses",
    "AbortTorchDistributed",
    "AbortTransformerEngine",
]
