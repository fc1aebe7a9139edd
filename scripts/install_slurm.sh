#!/usr/bin/env bash
# Install the Debian packages of the local test SLURM cluster, when missing.
#
# Idempotent and quiet: prints nothing and returns at once when everything is
# installed. Needs root and apt-get. No service is started by the packages'
# maintainer scripts (a temporary policy-rc.d forbids it); the test cluster
# (tests/support/slurm_cluster.py) starts its own daemons.
#
# Exit status: 0 installed, 1 install failed, 2 not root or no apt-get/dpkg.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
LOG=${NVRX_SLURM_INSTALL_LOG:-/var/log/nvrx-install-slurm.log}

if [ "$(id -u)" != 0 ]; then
    echo "install_slurm.sh: needs root (uid is $(id -u))" >&2
    exit 2
fi
for tool in apt-get dpkg-query; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "install_slurm.sh: $tool not found; install the packages by hand: ${PACKAGES[*]}" >&2
        exit 2
    fi
done

missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

policy=/usr/sbin/policy-rc.d
made_policy=0
cleanup() { if [ "$made_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# nvrx install_slurm.sh: start no services during install\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    made_policy=1
fi

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confold "${missing[@]}" >>"$LOG" 2>&1
}

: >"$LOG"
if ! apt_install; then
    # the package lists may be stale or absent: refresh once and retry
    apt-get update -q >>"$LOG" 2>&1 || true
    if ! apt_install; then
        echo "install_slurm.sh: apt-get install ${missing[*]} failed; last lines of $LOG:" >&2
        tail -n 20 "$LOG" >&2
        exit 1
    fi
fi
