#!/usr/bin/env bash
# Start a throwaway Slurm cluster on this machine: munged, slurmctld and one or two slurmd.
#
# Usage: slurm/up.sh [--nodes 1|2] [--dir DIR]
#   --nodes 1  one node named `localhost` (default)
#   --nodes 2  two nodes `n1`, `n2` at 127.0.1.1 / 127.0.1.2, each slurmd on its own port
#   --dir DIR  keep all state, pid and log files in DIR (created; default: a fresh mktemp -d)
#
# On success stdout holds ONLY shell `export` lines (SLURM_CONF, RESILIENCE_SLURM_DIR,
# RESILIENCE_SLURM_NODES, PATH with DIR/bin first, where a `sacct` wrapper lives), so
#     out=$(slurm/up.sh) && eval "$out"
# sets up the current shell. On failure: a message on stderr, everything started here is
# stopped, exit status non-zero: 3 when this machine cannot run it (not root, packages missing
# and not installable), 2 for bad arguments, 1 when the bring-up itself failed.
# Needs root; installs the Debian packages (slurm/install.sh) when missing.
# Stop with: slurm/down.sh "$RESILIENCE_SLURM_DIR"
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"

nodes=1
dir=""
usage() { echo "usage: slurm/up.sh [--nodes 1|2] [--dir DIR]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) [ $# -ge 2 ] || usage; nodes=$2; shift 2 ;;
        --nodes=*) nodes=${1#--nodes=}; shift ;;
        --dir) [ $# -ge 2 ] || usage; dir=$2; shift 2 ;;
        --dir=*) dir=${1#--dir=}; shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
        *) echo "slurm/up.sh: unknown argument '$1'" >&2; usage ;;
    esac
done
if [ "$nodes" != 1 ] && [ "$nodes" != 2 ]; then
    echo "slurm/up.sh: --nodes must be 1 or 2, got '$nodes'" >&2
    exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "slurm/up.sh: needs root (slurmd runs jobs as their users; munged runs as user munge)" >&2
    exit 3
fi

"$here/install.sh" >&2 || { echo "slurm/up.sh: slurm/install.sh failed" >&2; exit 3; }

# Resolve the real sacct before DIR/bin shadows it.
real_sacct=$(command -v sacct) || { echo "slurm/up.sh: sacct not found after install" >&2; exit 3; }

created_dir=0
if [ -z "$dir" ]; then
    dir=$(mktemp -d "${TMPDIR:-/tmp}/resilience-slurm.XXXXXX")
    created_dir=1
else
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    for f in "$dir"/run/*.pid "$dir"/munge/munged.pid; do
        pid=$(pid_from_file "$f")
        if [ -n "$pid" ] && pid_alive "$pid"; then
            echo "slurm/up.sh: $dir already has a running daemon (pid $pid from $f); run slurm/down.sh $dir first" >&2
            exit 1
        fi
    done
fi
# munged runs as user munge and must reach its files below DIR (mktemp -d makes 0700).
chmod 0755 "$dir"
touch "$dir/.resilience-slurm"   # marks DIR as ours, so down.sh may delete it
mkdir -p "$dir"/{state,spool,run,log,bin,munge}
conf="$dir/slurm.conf"

ok=0
cleanup() {
    [ "$ok" -eq 1 ] && return 0
    trap - EXIT INT TERM
    for log in "$dir"/log/slurmctld.log "$dir"/log/slurmd-*.log "$dir"/munge/munged.log; do
        [ -s "$log" ] || continue
        echo "---- last lines of $log" >&2
        tail -n 15 "$log" >&2 || true
    done
    stop_daemons "$dir" || true
    if [ "$created_dir" -eq 1 ]; then
        rm -rf -- "$dir"
    else
        echo "slurm/up.sh: logs kept in $dir/log" >&2
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { echo "slurm/up.sh: $*" >&2; exit 1; }

# A free local TCP port that nothing listens on and that this run has not handed out yet.
used_ports=" "
free_port() {
    local p i
    for ((i = 0; i < 200; i++)); do
        p=$((20000 + RANDOM % 40000))
        [[ "$used_ports" == *" $p "* ]] && continue
        if command -v ss >/dev/null 2>&1; then
            [ -n "$(ss -Htan "sport = :$p" 2>/dev/null)" ] && continue
        elif (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            continue
        fi
        used_ports+="$p "
        echo "$p"
        return 0
    done
    return 1
}

ctld_port=$(free_port) || fail "no free local port found"
if [ "$nodes" -eq 1 ]; then
    names=(localhost)
    addrs=(127.0.0.1)
else
    names=(n1 n2)
    addrs=(127.0.1.1 127.0.1.2)
fi
# Real memory from slurmd's own probe, shared between the nodes; CPUs are advertised, not real.
mem=$(SLURM_CONF=/dev/null slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)
[[ "$mem" =~ ^[0-9]+$ ]] && [ "$mem" -gt 0 ] || mem=2048
mem=$((mem / nodes))
node_lines=""
ports=()
for i in "${!names[@]}"; do
    p=$(free_port) || fail "no free local port found"
    ports+=("$p")
    mkdir -p "$dir/spool/${names[$i]}"
    node_lines+="NodeName=${names[$i]} NodeAddr=${addrs[$i]} NodeHostname=${names[$i]} Port=$p CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN"$'\n'
done
part_nodes=$(IFS=,; echo "${names[*]}")

text=$(<"$here/slurm.conf.in")
text=${text//@DIR@/$dir}
text=${text//@CLUSTER@/resilience}
text=${text//@CTLD_HOST@/$(hostname -s)}
text=${text//@CTLD_PORT@/$ctld_port}
text=${text//@SLURMD_PORT@/${ports[0]}}
text=${text//@NODES@/${node_lines%$'\n'}}
text=${text//@PART_NODES@/$part_nodes}
printf '%s\n' "$text" >"$conf"
chmod 0644 "$conf"

# submitit calls plain `sacct`, which fails without slurmdbd; --completion reads the jobcomp file.
cat >"$dir/bin/sacct" <<WRAP
#!/bin/sh
# sacct for the local cluster in $dir: no slurmdbd, so read the job completion file instead.
: "\${SLURM_CONF:=$conf}"
export SLURM_CONF
exec $(printf '%q' "$real_sacct") --completion "\$@"
WRAP
chmod 0755 "$dir/bin/sacct"

export SLURM_CONF="$conf"
t0=${EPOCHREALTIME/./}

# munged: own key, socket, pid, log and seed under DIR/munge, running as user munge.
chown munge:munge "$dir/munge"
chmod 0755 "$dir/munge"
head -c 1024 /dev/urandom >"$dir/munge/munge.key"
chown munge:munge "$dir/munge/munge.key"
chmod 0400 "$dir/munge/munge.key"
sock="$dir/munge/munge.socket.2"
runuser -u munge -- munged --socket="$sock" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
    --seed-file="$dir/munge/munged.seed" </dev/null >>"$dir/log/munged.out" 2>&1 \
    || fail "munged failed to start (see $dir/log/munged.out)"
munge -n -S "$sock" 2>/dev/null | unmunge -S "$sock" >/dev/null 2>&1 \
    || fail "munged does not answer on $sock"

# The daemons fork into the background; their stdio must not hold our stdout open, or
# `$(slurm/up.sh)` would wait for them forever.
slurmctld -i -f "$conf" </dev/null >>"$dir/log/slurmctld.out" 2>&1 \
    || fail "slurmctld failed to start (see $dir/log/slurmctld.log)"
for n in "${names[@]}"; do
    slurmd -N "$n" -f "$conf" </dev/null >>"$dir/log/slurmd-$n.out" 2>&1 \
        || fail "slurmd -N $n failed to start (see $dir/log/slurmd-$n.log)"
done

# Ready when every node is idle AND every daemon lives: with a port clash the second slurmd
# dies, yet sinfo still shows it idle because the first one answers its pings.
deadline=$(( $(date +%s) + ${RESILIENCE_SLURM_UP_TIMEOUT_S:-30} ))
while :; do
    alive=1
    for f in "$dir/run/slurmctld.pid" "$dir/munge/munged.pid"; do
        pid=$(pid_from_file "$f")
        [ -n "$pid" ] && pid_alive "$pid" || alive=0
    done
    for n in "${names[@]}"; do
        pid=$(pid_from_file "$dir/run/slurmd-$n.pid")
        [ -n "$pid" ] && pid_alive "$pid" || alive=0
    done
    states=$(sinfo -h -N -p debug -o '%N=%T' 2>/dev/null | sort -u | tr '\n' ' ') || states=""
    want=""
    for n in $(printf '%s\n' "${names[@]}" | sort); do want+="$n=idle "; done
    if [ "$alive" -eq 1 ] && [ "$states" = "$want" ]; then
        break
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        fail "cluster not ready after ${RESILIENCE_SLURM_UP_TIMEOUT_S:-30} s (node states: '${states:-none}', all daemons alive: $alive)"
    fi
    sleep 0.2
done
t1=${EPOCHREALTIME/./}
ms=$(( (t1 - t0) / 1000 ))
printf 'slurm/up.sh: %s-node cluster ready in %d.%03d s; dir %s\n' "$nodes" $((ms / 1000)) $((ms % 1000)) "$dir" >&2

# Plain values stay bare (easy to read and to parse); anything else is shell-quoted.
q() { if [[ "$1" =~ ^[A-Za-z0-9_./,:+=-]+$ ]]; then printf '%s' "$1"; else printf '%q' "$1"; fi; }
ok=1
echo "export SLURM_CONF=$(q "$conf")"
echo "export RESILIENCE_SLURM_DIR=$(q "$dir")"
echo "export RESILIENCE_SLURM_NODES=$(q "$part_nodes")"
echo "export PATH=$(q "$dir/bin"):\"\$PATH\""
