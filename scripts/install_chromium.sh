#!/usr/bin/env bash
# Install headless Chromium (and a font) for the browser test of nvrx-report's
# HTML page (tests/multiproc/test_report_html_browser.py), when missing.
#
# Idempotent and quiet: prints nothing and returns at once when everything is
# installed. Needs root and apt-get. Parallel runs (pytest workers, another
# test session) queue on one lock, and apt's own lock is waited for rather than
# failed on, so a SLURM install running beside it does not make it fail.
#
# Exit status: 0 installed, 1 install failed, 2 not root or no apt-get/dpkg/flock.
set -euo pipefail

PACKAGES=(chromium fonts-dejavu-core)
LOG=${NVRX_CHROMIUM_INSTALL_LOG:-/var/log/nvrx-install-chromium.log}
LOCK=${NVRX_CHROMIUM_INSTALL_LOCK:-/var/lock/nvrx-install-chromium.lock}

if [ "$(id -u)" != 0 ]; then
    echo "install_chromium.sh: needs root (uid is $(id -u)); install by hand: apt-get install ${PACKAGES[*]}" >&2
    exit 2
fi
for tool in apt-get dpkg-query flock; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "install_chromium.sh: $tool not found; install the packages by hand: ${PACKAGES[*]}" >&2
        exit 2
    fi
done

missing_packages() {
    missing=()
    for pkg in "${PACKAGES[@]}"; do
        status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
        [ "$status" = "install ok installed" ] || missing+=("$pkg")
    done
}

missing_packages
[ ${#missing[@]} -eq 0 ] && exit 0

exec 9>"$LOCK"
if ! flock -w 1200 9; then
    echo "install_chromium.sh: another install held $LOCK for 20 minutes; giving up" >&2
    exit 1
fi
missing_packages  # another run may have installed them while this one waited
[ ${#missing[@]} -eq 0 ] && exit 0

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o DPkg::Lock::Timeout=600 -o Dpkg::Options::=--force-confold "${missing[@]}" >>"$LOG" 2>&1
}

: >"$LOG"
if ! apt_install; then
    # the package lists may be stale or absent: refresh once and retry
    apt-get update -q -o DPkg::Lock::Timeout=600 >>"$LOG" 2>&1 || true
    if ! apt_install; then
        echo "install_chromium.sh: apt-get install ${missing[*]} failed; last lines of $LOG:" >&2
        tail -n 20 "$LOG" >&2
        exit 1
    fi
fi
