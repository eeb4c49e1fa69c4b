#!/usr/bin/env bash
# Install the Debian packages a local Slurm cluster needs: slurmctld, slurmd, slurm-client, munge.
# Idempotent: does nothing (and touches no network) when every binary is already present.
# Exits non-zero with a message on stderr when not root or when apt-get is unavailable.
set -euo pipefail

need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd    >/dev/null 2>&1 || need+=(slurmd)
command -v sbatch    >/dev/null 2>&1 || need+=(slurm-client)
command -v munged    >/dev/null 2>&1 || need+=(munge)
# munged runs as this user; the munge package creates it.
id -u munge >/dev/null 2>&1 || need+=(munge)

if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "slurm/install.sh: missing ${need[*]}; installing needs root (run as root, or install them yourself)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "slurm/install.sh: missing ${need[*]} and apt-get is not available (needs a Debian/Ubuntu system)" >&2
    exit 1
fi

# Install all four even if only some are missing: their versions must match each other.
echo "slurm/install.sh: installing slurmctld slurmd slurm-client munge" >&2
if ! apt-get update -q >&2; then
    echo "slurm/install.sh: apt-get update failed" >&2
    exit 1
fi
# --no-install-recommends: 8 packages instead of ~43, none of the extras are needed.
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client munge >&2; then
    echo "slurm/install.sh: apt-get install slurmctld slurmd slurm-client munge failed" >&2
    exit 1
fi
# Post-install scripts try to start the services; on machines without systemd they are refused,
# and up.sh starts its own daemons anyway.
for b in slurmctld slurmd sbatch munged; do
    if ! command -v "$b" >/dev/null 2>&1; then
        echo "slurm/install.sh: $b still missing after install" >&2
        exit 1
    fi
done
