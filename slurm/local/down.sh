#!/usr/bin/env bash
# Stop the local Slurm cluster started by slurm/local/up.sh. Idempotent.
#
#   bash slurm/local/down.sh           # cancel all jobs, stop slurmd n1/n2, slurmctld, munged
#   bash slurm/local/down.sh --wipe    # ... and remove the state folder (job ids restart at 1)
#
# Jobs keep running after slurmd stops, so they are cancelled first.
set -uo pipefail

STATE=${LAUNCHER_SLURM_STATE:-/tmp/launcher-slurm}
export SLURM_CONF=$STATE/slurm.conf
PATH=$PATH:/usr/sbin:/sbin
wipe=0
for arg in "$@"; do
    case $arg in
        --wipe) wipe=1 ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) echo "down.sh: unknown argument $arg (use --wipe)" >&2; exit 2 ;;
    esac
done

say() { echo "down.sh: $*"; }

if [[ $(id -u) -ne 0 ]]; then
    echo "down.sh: needs root (the daemons run as root); running as $(id -un)" >&2
    exit 3
fi

# alive PIDFILE NAME -> prints the pid when the pid file names a live process whose command is NAME.
alive() {
    local pid
    [[ -f $1 ]] && pid=$(<"$1") && [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null \
        && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] && echo "$pid"
}

# stop NAME:PIDFILE...: SIGTERM to all of them at once, wait up to 15 s, then SIGKILL.
stop() {
    local item pid pids=() files=()
    for item in "$@"; do
        pid=$(alive "${item#*:}" "${item%%:*}") || continue
        say "stopping ${item%%:*} (pid $pid)"
        kill -TERM "$pid" 2>/dev/null
        pids+=("$pid"); files+=("${item#*:}")
    done
    ((${#pids[@]})) || return 0
    any_alive() { local p; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
    for _ in $(seq 150); do any_alive || break; sleep 0.1; done
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            say "pid $pid ignored SIGTERM for 15 s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null
        fi
    done
    rm -f "${files[@]}"
}

# Cancel jobs while slurmctld still answers, then give them a moment to end.
if [[ -f $SLURM_CONF ]] && command -v scancel >/dev/null && alive "$STATE/run/slurmctld.pid" slurmctld >/dev/null; then
    mapfile -t ids < <(timeout 10 squeue -h -o %i 2>/dev/null)
    if ((${#ids[@]} > 0)); then
        say "cancelling ${#ids[@]} job(s): ${ids[*]}"
        timeout 10 scancel --full -u root >/dev/null 2>&1 || true
        timeout 10 scancel --full "${ids[@]}" >/dev/null 2>&1 || true  # any other user's
        for _ in $(seq 50); do
            [[ -z $(timeout 5 squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
fi

# Each takes ~2 s to exit on SIGTERM: stop the three Slurm daemons together, munged after them.
stop "slurmd:$STATE/run/slurmd.n1.pid" "slurmd:$STATE/run/slurmd.n2.pid" "slurmctld:$STATE/run/slurmctld.pid"
stop "munged:/run/munge/munged.pid"

if ((wipe)); then
    case $STATE in
        /|"") echo "down.sh: refusing to wipe '$STATE'" >&2; exit 1 ;;
    esac
    say "removing $STATE"
    rm -rf -- "$STATE"
fi
say "stopped"
