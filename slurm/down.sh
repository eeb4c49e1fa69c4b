#!/usr/bin/env bash
# Stop a cluster that slurm/up.sh started, and delete its directory.
#
# Usage: slurm/down.sh [--keep] DIR
#   --keep  keep DIR (logs, job completion file, state) instead of deleting it
#
# Cancels every job and waits (at most RESILIENCE_SLURM_DOWN_WAIT_S, default 20 s) until none
# is running or completing, kills processes that jobs left behind, then stops slurmd(s),
# slurmctld and munged by their pid files (SIGTERM, then SIGKILL after 5 s). Exits 1 if a
# daemon survives. Safe to run twice, and on a half-started DIR.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"

keep=0
dir=""
for a in "$@"; do
    case "$a" in
        --keep) keep=1 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
        -*) echo "slurm/down.sh: unknown option '$a'" >&2; exit 2 ;;
        *) [ -z "$dir" ] || { echo "slurm/down.sh: one DIR only" >&2; exit 2; }; dir=$a ;;
    esac
done
if [ -z "$dir" ]; then
    echo "usage: slurm/down.sh [--keep] DIR   (DIR is \$RESILIENCE_SLURM_DIR from slurm/up.sh)" >&2
    exit 2
fi
if [ ! -d "$dir" ]; then
    echo "slurm/down.sh: $dir does not exist; nothing to stop" >&2
    exit 0
fi
dir=$(cd "$dir" && pwd)
if [ ! -e "$dir/.resilience-slurm" ]; then
    echo "slurm/down.sh: $dir was not made by slurm/up.sh (no .resilience-slurm marker); refusing" >&2
    exit 2
fi
export SLURM_CONF="$dir/slurm.conf"

ctld=$(pid_from_file "$dir/run/slurmctld.pid")
if [ -n "$ctld" ] && pid_alive "$ctld" && [ -e "$SLURM_CONF" ]; then
    jobs=$(squeue -h -o '%A' 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        deadline=$(( $(date +%s) + ${RESILIENCE_SLURM_DOWN_WAIT_S:-20} ))
        while :; do
            left=$(squeue -h -t RUNNING,COMPLETING,CONFIGURING,SUSPENDED,STOPPED,SIGNALING,PENDING,REQUEUED,REQUEUE_HOLD,REQUEUE_FED,RESIZING -o '%A' 2>/dev/null) || break
            [ -z "$left" ] && break
            if [ "$(date +%s)" -ge "$deadline" ]; then
                echo "slurm/down.sh: jobs still not finished after ${RESILIENCE_SLURM_DOWN_WAIT_S:-20} s: $(echo $left); stopping anyway" >&2
                break
            fi
            # A requeued job may come back as pending; cancel whatever is listed again.
            # shellcheck disable=SC2086
            scancel $left 2>/dev/null || true
            sleep 0.2
        done
    fi
fi

sweep_job_leftovers "$dir"
rc=0
stop_daemons "$dir" || rc=1
# Job steps outlive a stopped slurmd; anything of this cluster still here gets SIGKILL.
sweep_job_leftovers "$dir"

if [ "$rc" -ne 0 ]; then
    echo "slurm/down.sh: a daemon survived SIGKILL; keeping $dir" >&2
    exit 1
fi
if [ "$keep" -eq 1 ]; then
    echo "slurm/down.sh: stopped; logs kept in $dir/log" >&2
else
    rm -rf -- "$dir"
fi
exit 0
