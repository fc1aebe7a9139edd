"""Causal attribution: which faults follow from another fault, and what tells against a node.

This is the one rule the timeline, the failure groups, the suspect table and
the HTML timeline apply (``docs/report.md``, *Causal attribution*):

- a fault's *shape* is read once, when its event is folded: ``FOLLOW_ON``
  when it tells that something else went first (a communication error about
  a remote peer, a lost store connection, an abort by the Wrapper),
  ``HARDWARE`` when it tells of the node's own device or driver, else none. NCCL's
  "unhandled system error" is a failed system call: the node's own only when the
  message names no remote peer (the survivors of a peer's death get it too);
- a fault counts from its *onset*: its time less its ``detection_s`` (a hang's
  report less the time the rank had made no progress, ``stale_s``);
- a node loss explains a survivor's fault of its own run begun from the lost node's
  last beat until the job got over the loss, and no later than the run's end (its
  *loss window*), and a follow-on fault
  begun in the loss's detection window before that beat: up to ``silent_s``
  (the node timeout) before it, since the survivor may see the broken
  connection before the lost node's last heartbeat reaches its peers. For the
  loss's windows a hang is a follow-on fault (``loss_shape``): a rank blocked
  on the lost peer stops making progress before the peer's last beat, so a
  hang begun in the detection window counts as the loss's even if it was the
  rank's own;
- a follow-on fault is a round's first failure only when no fault of another
  shape is at hand, and it is never evidence against its node.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from nvrx.events.failures import HANG, kind_of, short_type

if TYPE_CHECKING:
    from .model import NodeLoss

#: A fault that follows from another one's.
FOLLOW_ON = "follow_on"
#: A fault of the node's own device or driver.
HARDWARE = "hardware"

#: Exception types raised by a rank because another rank, the store or the Wrapper went first.
_FOLLOW_ON_TYPES = frozenset(
    {
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "RestartAbort",
        "StoreGone",
        "StoreTimeout",
    }
)
#: Words of a message that tell of a remote peer or the store going away (lowercase).
_FOLLOW_ON_WORDS = (
    "connection reset by peer",
    "connection closed by peer",
    "connection refused",
    "broken pipe",
    "communicator was aborted",
    "remote process exited",
    "remote peer",
    "peer closed",
    "store connection",
    "connection to the store",
)
#: Exception types that tell of the node's devices.
_HARDWARE_TYPES = frozenset({"HealthCheckError"})
#: Words of a message that tell of the node's device or driver (lowercase), whatever else
#: it says.
_HARDWARE_WORDS = re.compile(
    r"ecc error|uncorrectable ecc|(?<![a-z])xid(?![a-z])|unspecified launch failure|gpu is lost|"
    r"fallen off the bus|nvlink|driver/library version mismatch|cuda driver|device health"
)
#: Words of an exception's message that may tell of the rank's device (its GPU, its link),
#: though not that it failed: such an exception repeated by one rank still counts against
#: the node. The first ones match inside names too: WorkNCCL, c10::CUDAError.
_DEVICE_WORDS = re.compile(
    r"cuda|cublas|cudnn|nccl|illegal memory access|(?<![a-z])(gpus?|ecc|xid)(?![a-z])"
)
#: Words of a message that tell of the node's device or driver unless it also tells of a
#: remote peer: a system call NCCL made failed (a socket to a peer that died, as well).
_SYSTEM_WORDS = ("unhandled system error", "ncclsystemerror")
#: Words of a message that tell of a failed CUDA call of its own (NCCL's): no follow-on
#: fault whatever its type, yet no proof of bad hardware either (NCCL out of memory, a bad
#: argument): it counts as the node's own fault, repeated or not.
_OWN_CUDA_WORDS = ("unhandled cuda error",)


def names_a_device(text: str) -> bool:
    """Whether ``text`` (an exception's signature or message) names the rank's device; not
    where it ran out of memory there (the workload's size, on any node)."""
    lowered = text.lower()
    return "out of memory" not in lowered and bool(_DEVICE_WORDS.search(lowered))


def fault_shape(exc_type: str | None, message: str | None, signature: str | None) -> str | None:
    """``FOLLOW_ON``, ``HARDWARE`` or None, by a fault's exception type and message (its
    signature stands in for the type when the event names none)."""
    kind = short_type(exc_type) if exc_type else short_type((signature or "").split(" ")[0])
    text = (message or "").lower()
    if kind in _HARDWARE_TYPES or _HARDWARE_WORDS.search(text):
        return HARDWARE
    peer = any(w in text for w in _FOLLOW_ON_WORDS)
    if not peer and any(w in text for w in _SYSTEM_WORDS):
        return HARDWARE
    if not peer and any(w in text for w in _OWN_CUDA_WORDS):
        return None
    if kind in _FOLLOW_ON_TYPES or peer:
        return FOLLOW_ON
    return None


def loss_shape(signature: str | None, shape: str | None) -> str | None:
    """The shape a fault of ``signature`` has for a node loss's windows: its own
    (``fault_shape``), except that a hang is a follow-on one. An unresponsive monitor is
    not: only the Wrapper's monitors beat, and a rank blocked on a lost peer is a hang
    while its monitor goes on beating; an unresponsive one means its own host froze."""
    if signature is not None and kind_of(signature) == HANG:
        return FOLLOW_ON
    return shape


def loss_explains(
    loss: NodeLoss,
    until: float,
    wall: float | None,
    shape: str | None = None,
    signature: str | None = None,
) -> bool:
    """Whether what a survivor wrote, or a fault of ``signature`` and ``shape`` it began, at
    ``wall`` (a fault's onset) follows from ``loss`` (window up to ``until``): anything in the
    loss window, and a follow-on fault (``loss_shape``) in the detection window before it."""
    if wall is None:
        return False
    shape = loss_shape(signature, shape)
    start = loss.start
    if until <= start:  # a lost spare: nothing to get over
        return False
    if start <= wall < until:
        return True
    return shape == FOLLOW_ON and start - (loss.silent_s or 0.0) <= wall < start
