# Shared helpers for slurm/up.sh and slurm/down.sh (sourced, not run). Messages go to stderr.

# True when PID names a live process. A zombie answers `kill -0` but is already dead, so it
# counts as gone (daemons reparented to a non-reaping PID 1 can linger as zombies).
pid_alive() {
    local pid=$1 state
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$pid/status" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# Print the PID from a pid file, or nothing when the file is missing or holds no number.
pid_from_file() {
    local pid=""
    [ -r "$1" ] && read -r pid <"$1" 2>/dev/null
    [[ "$pid" =~ ^[0-9]+$ ]] && echo "$pid"
    return 0
}

# stop_pid NAME PID: SIGTERM, wait up to STOP_WAIT_S (default 5) seconds, then SIGKILL and
# wait up to 2 s more. Returns 1 if the process still lives after that.
stop_pid() {
    local name=$1 pid=$2 i
    pid_alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < ${STOP_WAIT_S:-5} * 10; i++)); do
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    echo "slurm: $name (pid $pid) ignored SIGTERM for ${STOP_WAIT_S:-5} s; sending SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 20; i++)); do
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    echo "slurm: $name (pid $pid) still alive after SIGKILL" >&2
    return 1
}

# stop_pidfile NAME FILE: stop the process named by a pid file, then remove the file.
stop_pidfile() {
    local pid rc=0
    pid=$(pid_from_file "$2")
    if [ -n "$pid" ]; then
        stop_pid "$1" "$pid" || rc=1
    fi
    [ "$rc" -ne 0 ] || rm -f "$2"
    return "$rc"
}

# Kill processes that jobs of the cluster in DIR left behind (reparented to PID 1 when a batch
# script exits without waiting for them). Only processes whose environment has SLURM_JOB_ID
# and SLURM_CONF=DIR/slurm.conf are touched, never this script or its ancestors.
sweep_job_leftovers() {
    local dir=$1 conf="$1/slurm.conf" p pid found=() ancestors=" " a=$$
    while [[ "$a" =~ ^[0-9]+$ ]] && [ "$a" -gt 1 ]; do
        ancestors+="$a "
        a=$(sed -n 's/^PPid:[[:space:]]*//p' "/proc/$a/status" 2>/dev/null)
    done
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [[ "$ancestors" == *" $pid "* ]] && continue
        grep -qzxF "SLURM_CONF=$conf" "$p/environ" 2>/dev/null || continue
        grep -qz '^SLURM_JOB_ID=' "$p/environ" 2>/dev/null || continue
        found+=("$pid")
    done
    [ "${#found[@]}" -eq 0 ] && return 0
    echo "slurm: killing ${#found[@]} process(es) left behind by jobs: ${found[*]}" >&2
    for pid in "${found[@]}"; do
        kill -KILL "$pid" 2>/dev/null || true
    done
}

# stop_daemons DIR: slurmd(s), then slurmctld, then munged, each by its pid file only.
stop_daemons() {
    local dir=$1 f rc=0
    for f in "$dir"/run/slurmd-*.pid; do
        [ -e "$f" ] || continue
        stop_pidfile "slurmd $(basename "$f" .pid)" "$f" || rc=1
    done
    stop_pidfile slurmctld "$dir/run/slurmctld.pid" || rc=1
    stop_pidfile munged "$dir/munge/munged.pid" || rc=1
    return "$rc"
}
