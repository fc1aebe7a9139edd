"""The shape of a fault (``consequence.fault_shape``): follow-on, hardware, or its own."""

from __future__ import annotations

import pytest

from nvrx.report.consequence import FOLLOW_ON, HARDWARE, fault_shape


@pytest.mark.parametrize(
    ("exc_type", "message", "signature", "shape"),
    [
        (
            "RuntimeError",
            "[gloo/transport/tcp/pair.cc:534] Connection reset by peer",
            None,
            FOLLOW_ON,
        ),
        ("RuntimeError", "Connection closed by peer [10.0.0.2]:4321", None, FOLLOW_ON),
        ("torch.distributed.DistBackendError", "NCCL error", None, FOLLOW_ON),
        (None, None, "DistNetworkError at train.py:9 in step", FOLLOW_ON),
        ("nvrx.inprocess.exception.RestartAbort", None, None, FOLLOW_ON),
        ("RuntimeError", "CUDA error: uncorrectable ECC error encountered", None, HARDWARE),
        ("nvrx.inprocess.exception.HealthCheckError", "GPU 0: reset required", None, HARDWARE),
        (
            "torch.distributed.DistBackendError",
            "NCCL error: unhandled system error",
            None,
            HARDWARE,
        ),
        (  # a survivor of a peer's death: NCCL's system error names the remote peer
            "torch.distributed.DistBackendError",
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error, ncclSystemError: "
            "Connection closed by remote peer 10.0.0.2<54321>",
            None,
            FOLLOW_ON,
        ),
        ("RuntimeError", "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", None, HARDWARE),
        ("KeyError", "'taxid'", None, None),  # a word that holds "xid" is no Xid
        ("RuntimeError", "DCGM_FR_XID_ERROR: xid79 on GPU 3", None, HARDWARE),
        ("ZeroDivisionError", "division by zero", None, None),
        ("ValueError", "bad batch 17", "ValueError at train.py:12 in step", None),
        (None, None, "signal SIGKILL", None),
    ],
)
def test_fault_shape(
    exc_type: str | None, message: str | None, signature: str | None, shape: str | None
) -> None:
    assert fault_shape(exc_type, message, signature) == shape
