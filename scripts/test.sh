#!/usr/bin/env bash
# Set up .venv (and .venv-nvrx, the reference of the differential tier) and run every test
# tier (unit, multiproc, differential, slurm) plus ruff.
# As root with apt, SLURM is installed first and the slurm tier runs against a
# real local cluster that the test session starts and stops; elsewhere that
# tier skips with the reason. Extra arguments go to pytest, for example:
#   scripts/test.sh -m slurm                       one tier
#   scripts/test.sh --repeat 5 -m slurm            the whole tier 5 times, each a new session (flake hunting)
#   scripts/test.sh --repeat 20 tests/slurm/test_preemption.py::test_requeue_template_forwards_the_warning
#   scripts/test.sh --repeat-each 5 tests/unit      each test 5 times within one session (fixtures shared)
#   NVRX_TEST_WORKERS=1 scripts/test.sh -m unit     one test at a time, in the pytest process itself
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# Tests run in NVRX_TEST_WORKERS pytest-xdist workers (default 2): a multi-process test
# spends much of its time waiting on its processes, so two share the machine's cores.
# The SLURM tier and the differential tier each stay whole on one worker (tests/conftest.py).
workers=${NVRX_TEST_WORKERS:-2}
case "$workers" in
    ''|*[!0-9]*) workers_ok=0 ;;
    *) [ "$((10#$workers))" -ge 1 ] && workers_ok=1 || workers_ok=0 ;;
esac
[ "$workers_ok" = 1 ] || { echo "test.sh: NVRX_TEST_WORKERS must be a whole number >= 1, got '$workers'" >&2; exit 2; }
workers=$((10#$workers))
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers")

bash scripts/setup.sh || { echo "test.sh: setup failed" >&2; exit 1; }
# The differential tier's reference (NVRx 0.4.1 in .venv-nvrx); without it that tier skips
# and says why.
bash scripts/setup_nvrx_reference.sh || echo "test.sh: NVRx reference not installed: the differential tier will skip" >&2
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    bash scripts/install_slurm.sh || { echo "test.sh: SLURM install failed" >&2; exit 1; }
fi

# Live (not zombie) SLURM/MariaDB/munge daemons, as "pid name" lines.
daemons() { ps -eo pid=,stat=,comm= | awk '$2 !~ /^Z/ && $3 ~ /^(slurmctld|slurmd|slurmdbd|mariadbd|munged)$/ {print $1" "$3}' | sort; }
before=$(daemons)

.venv/bin/ruff check . || { echo "test.sh: ruff check failed" >&2; exit 1; }
if [ "${1:-}" = "--repeat" ]; then
    [ $# -ge 2 ] || { echo "test.sh: --repeat needs a number of rounds, e.g. --repeat 5" >&2; exit 2; }
    rounds=$2
    shift 2
    .venv/bin/python scripts/repeat_tests.py "$rounds" "${parallel[@]}" "$@"
else
    .venv/bin/python -m pytest "${parallel[@]}" "$@"
fi
rc=$?

# Daemons the tests started must be gone (pids that were not there before).
left=$(comm -13 <(echo "$before") <(daemons))
if [ -n "$left" ]; then
    echo "test.sh: daemons started by the tests are still running:" >&2
    echo "$left" >&2
    rc=1
fi
echo "test.sh: pytest exit $rc, wall $(( $(date +%s) - start )) s"
exit $rc
