"""How often a restart's signal misses a blocking call entered right after it.

The monitor thread raises the restart in the main thread with a signal whose handler
raises ``RankShouldRestart``; the signal also interrupts a blocking call. One that lands in
the bytecodes just before the call interrupts nothing, and the handler runs once the call
returned. Each trial: the main thread is in user code, the monitor thread delivers the
restart, the main thread runs a short loop and then sleeps ``--sleep`` seconds; the trial
counts as missed when the sleep ran to its end. Run once with the signal sent once
(``Delivery.deliver`` alone) and once with it sent again until taken (``keep_waking``).
A miss needs the main thread to be held up between giving up the GIL and the sleep's
system call, as on a loaded node: ``--load N`` keeps N busy processes beside the trials.

    .venv/bin/python bench/restart_signal.py [--trials 300] [--sleep 0.3] [--load 3]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from nvrx import processes
from nvrx.inprocess.monitor_thread import Delivery, RankShouldRestart


def trial(keep_waking: bool, sleep_s: float, spin: int) -> tuple[bool, int]:
    """One delivery during a sleep; (whether the sleep ran to its end, restarts raised)."""
    delivery = Delivery()
    delivery.install_signal()
    go = threading.Event()

    def monitor() -> None:
        go.wait()
        delivery.deliver("a rank faulted: restarting")
        if keep_waking:
            delivery.keep_waking()

    thread = threading.Thread(target=monitor)
    thread.start()
    raised = 0
    delivery.enter_user()
    t0 = time.monotonic()
    try:
        go.set()
        for _ in range(spin):  # the bytecodes between a failed collective and the wait
            pass
        time.sleep(sleep_s)
    except RankShouldRestart:
        raised += 1
        delivery.caught()
    elapsed = time.monotonic() - t0
    try:
        delivery.leave_user()
    except RankShouldRestart:
        raised += 1
    thread.join(10)
    delivery.uninstall_signal()
    return elapsed >= sleep_s, raised


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=300, help="deliveries per way (default 300)")
    parser.add_argument("--sleep", type=float, default=0.3, help="the blocking call, seconds")
    parser.add_argument("--spin", type=int, default=200, help="loop turns before the call")
    parser.add_argument("--load", type=int, default=3, help="busy processes beside the trials")
    args = parser.parse_args()
    busy = [processes.start([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        for keep_waking in (False, True):
            results = [trial(keep_waking, args.sleep, args.spin) for _ in range(args.trials)]
            missed = sum(1 for full, _ in results if full)
            twice = sum(1 for _, raised in results if raised != 1)
            label = "signal sent again until taken" if keep_waking else "signal sent once"
            print(f"{label:31}: {missed:4d} of {args.trials} sleeps ran to their end "
                  f"({100 * missed / args.trials:.1f} %); restart not raised exactly once: {twice}")  # fmt: skip
    finally:
        processes.stop_all(busy, ask=None)
    print(f"({args.load} busy processes beside the trials)")


if __name__ == "__main__":
    main()
