"""One rank calls a wrapped function whose annotations are strings (``from __future__ import
annotations``, as much typed code has): is the ``CallWrapper`` injected?

The record holds what the call returned or raised and what the function received for its
``call_wrapper`` parameter. CASE is unused.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import common


def main() -> int:
    impl, out, _ = common.arguments()
    inprocess = common.module(impl, "inprocess")
    common.module(impl, "inprocess.initialize")
    received: list[str] = []

    def train(step: int, call_wrapper: inprocess.CallWrapper = None) -> int:
        received.append(type(call_wrapper).__name__)
        return step + 1

    s = datetime.timedelta(seconds=1)
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 1},
        initialize=inprocess.initialize.RetryController(max_iterations=1),
        soft_timeout=6 * s, hard_timeout=9 * s, heartbeat_timeout=5 * s,
        barrier_timeout=20 * s, completion_timeout=20 * s,
    )  # fmt: skip
    record: dict[str, Any] = {"returned": None, "raised": None}
    try:
        record["returned"] = wrapper(train)(1)
    except BaseException as exc:
        record["raised"] = common.exception_fields(exc)
    record["received"] = received
    common.write(out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
