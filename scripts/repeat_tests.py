"""Run the same pytest session N times, to hunt flaky tests: ``scripts/test.sh --repeat N [pytest args]``.

Each round is a whole new pytest session, so every fixture (a TCPStore, a
module's training run, the SLURM cluster) is built again: a flake that
depends on set-up timing shows up too, which repeating tests inside one
session (``--repeat-each``) cannot show. Every round runs, so the last line
counts the rounds that failed; the exit code is 0 only when none did.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="repeat_tests", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("rounds", type=int, help="how many pytest sessions to run")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="arguments for pytest")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--repeat must be at least 1, got {args.rounds}")
    failed: list[int] = []
    for round_no in range(1, args.rounds + 1):
        print(f"repeat: round {round_no}/{args.rounds}", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "pytest", *args.pytest_args])
        took = time.monotonic() - started
        print(f"repeat: round {round_no}/{args.rounds} exit {code} in {took:.0f} s", flush=True)
        if code != 0:
            failed.append(round_no)
    rounds = ", ".join(map(str, failed)) or "none"
    print(f"repeat: {args.rounds} rounds, {len(failed)} failed (rounds: {rounds})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
