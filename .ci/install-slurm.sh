#!/usr/bin/env bash
# Install Debian's Slurm (22.05 on bookworm) and MUNGE for the throwaway test cluster.
#
# Installs packages only: tests/harness/slurm_cluster.py starts its own munged, slurmctld and slurmd
# on loopback with every path under a temp dir, so the packaged services must stay stopped.
# Idempotent: re-running on a machine that already has the packages does nothing harmful.
# Must run as root; non-interactive.
set -euo pipefail

PACKAGES=(slurm-wlm munge)

if [[ "$(id -u)" != 0 ]]; then
    echo "install-slurm.sh: must run as root (it calls apt-get install)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive

# Package postinst scripts call invoke-rc.d / deb-systemd-invoke to start munge, slurmctld and
# slurmd. A policy-rc.d that exits 101 forbids that. Containers often ship one already; only
# install (and later remove) ours when there is none, so we never delete somebody else's.
POLICY=/usr/sbin/policy-rc.d
OUR_POLICY=0
if [[ ! -e "$POLICY" ]]; then
    printf '#!/bin/sh\n# temporary, from procckpt .ci/install-slurm.sh\nexit 101\n' >"$POLICY"
    chmod 0755 "$POLICY"
    OUR_POLICY=1
fi
cleanup() {
    if [[ "$OUR_POLICY" == 1 ]]; then
        rm -f "$POLICY"
    fi
}
trap cleanup EXIT

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]})); then
    # Other jobs on the same machine may hold the dpkg lock briefly: wait instead of failing.
    apt_opts=(-o DPkg::Lock::Timeout=600)
    apt-get "${apt_opts[@]}" update
    apt-get "${apt_opts[@]}" install -y --no-install-recommends "${PACKAGES[@]}"
else
    echo "install-slurm.sh: ${PACKAGES[*]} already installed"
fi

# Belt and braces, only right after we installed (so a re-run never stops the services of a
# machine that uses them): if a service started anyway (systemd ignoring policy-rc.d, or an
# init script), stop it so it does not hold the default ports or /run/munge.
if ((${#missing[@]})); then
    for svc in slurmctld slurmd munge; do
        if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
            systemctl stop "$svc" >/dev/null 2>&1 || true
        elif [[ -x "/etc/init.d/$svc" ]]; then
            "/etc/init.d/$svc" stop >/dev/null 2>&1 || true
        fi
    done
fi

for bin in slurmctld slurmd munged sbatch scontrol; do
    if ! command -v "$bin" >/dev/null; then
        echo "install-slurm.sh: $bin not found on PATH after install" >&2
        exit 1
    fi
done
echo "install-slurm.sh: $(slurmctld -V), $(munged --version 2>&1 | head -n1)"
