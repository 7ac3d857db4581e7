#!/usr/bin/env bash
# Start a real Slurm cluster on this machine: munged, slurmctld and two slurmd "nodes" (n1, n2)
# sharing this host. Idempotent: what already runs is left alone, so running it again is quick.
#
#   bash slurm/local/up.sh            # then: export SLURM_CONF=/tmp/launcher-slurm/slurm.conf
#   bash slurm/local/down.sh [--wipe]
#
# State (slurm.conf, spool, state, logs, pid files) lives in ${LAUNCHER_SLURM_STATE:-/tmp/launcher-slurm}.
# Exit status: 0 up; 1 a daemon did not come up (the logs' last lines are printed);
# 3 not root (nothing done); 4 the packages could not be installed.
set -euo pipefail

STATE=${LAUNCHER_SLURM_STATE:-/tmp/launcher-slurm}
CONF=$STATE/slurm.conf
WAIT_S=${LAUNCHER_SLURM_WAIT:-30}
export SLURM_CONF=$CONF

say() { echo "up.sh: $*"; }

if [[ $(id -u) -ne 0 ]]; then
    echo "up.sh: needs root (installs packages, runs slurmctld/slurmd as root, may edit /etc/hosts); running as $(id -un)" >&2
    exit 3
fi

# --- packages -------------------------------------------------------------------------------
have_all() { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null 2>&1
PATH=$PATH:/usr/sbin:/sbin
mkdir -p "$STATE"/{state,spool,log,run}
APTLOG=$STATE/log/apt.log
if ! have_all; then
    pkgs=(slurmctld slurmd slurm-client munge)
    say "installing ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! timeout 300 apt-get install -y --no-install-recommends "${pkgs[@]}" >"$APTLOG" 2>&1; then
        say "install failed; running apt-get update and trying again"
        if ! { timeout 300 apt-get update && timeout 300 apt-get install -y --no-install-recommends "${pkgs[@]}"; } \
                >>"$APTLOG" 2>&1; then
            tail -n 15 "$APTLOG" >&2
            echo "up.sh: apt-get could not install ${pkgs[*]} (log: $APTLOG)" >&2
            exit 4
        fi
    fi
    have_all || { echo "up.sh: installed, but slurmctld/slurmd/sbatch/munged still not on PATH" >&2; exit 4; }
fi

# --- failure report ---------------------------------------------------------------------------
fail() {
    echo "up.sh: $*" >&2
    for log in "$STATE"/log/slurmctld.log "$STATE"/log/slurmd.n1.log "$STATE"/log/slurmd.n2.log \
               /var/log/munge/munged.log; do
        [[ -f $log ]] || continue
        echo "---- last lines of $log" >&2
        grep -v -E 'pmix|MPI: Cannot create context' "$log" | tail -n 12 >&2
    done
    exit 1
}

# --- configuration ----------------------------------------------------------------------------
HOST=$(hostname -s)
chmod 755 "$STATE"

new_conf=$(cat <<EOF
# Written by slurm/local/up.sh; rewritten on every run. Two nodes on one host.
ClusterName=launcher
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000
ReturnToService=2
JobRequeue=1
MinJobAge=3600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=2 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$new_conf" ]]; then
    [[ -f $CONF ]] && say "slurm.conf changed; daemons already running keep the old one until down.sh && up.sh"
    printf '%s\n' "$new_conf" >"$CONF"
fi

# Node names must resolve (torchrun --master_addr=n1 hangs on "gai error: -2" otherwise).
if ! getent hosts n1 >/dev/null || ! getent hosts n2 >/dev/null; then
    echo "127.0.0.1 n1 n2" >>/etc/hosts
    say "added '127.0.0.1 n1 n2' to /etc/hosts"
fi

# --- daemons ----------------------------------------------------------------------------------
# alive PIDFILE NAME: the pid file names a live process whose command is NAME.
alive() {
    local pid
    [[ -f $1 ]] && pid=$(<"$1") && [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null \
        && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}
munge_ok() { timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; }

# munge
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
chmod 755 /run/munge
if [[ ! -f /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
fi
if alive /run/munge/munged.pid munged && munge_ok; then
    :
else
    say "starting munged"
    # --force: start even if an earlier munged left its socket or pid file behind.
    timeout 20 runuser -u munge -- /usr/sbin/munged --force || fail "munged did not start"
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || fail "munge -n | unmunge fails"
fi

# slurmctld
if ! alive "$STATE/run/slurmctld.pid" slurmctld; then
    say "starting slurmctld"
    timeout 30 slurmctld -f "$CONF" || fail "slurmctld did not start"
fi
for _ in $(seq $((WAIT_S * 5))); do timeout 5 scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
timeout 5 scontrol ping 2>/dev/null | grep -q UP || fail "slurmctld does not answer scontrol ping"

# slurmd, one per node
fresh=()  # nodes started now: up once slurmctld has their registration (SlurmdStartTime >= now)
started_at=$(date +%s)
for node in n1 n2; do
    if ! alive "$STATE/run/slurmd.$node.pid" slurmd; then
        say "starting slurmd -N $node"
        fresh+=("$node")
        rm -f "$STATE/run/slurmd.$node.pid"
        mkdir -p "$STATE/spool/$node"
        timeout 30 slurmd -f "$CONF" -N "$node" || fail "slurmd -N $node did not start"
    fi
done

# --- wait until both nodes take jobs ---------------------------------------------------------
# Nodes busy with jobs (allocated, mixed, completing) count as up: another user may be running.
resumed_at=-100
deadline=$((SECONDS + WAIT_S))
while :; do
    states=$(timeout 5 sinfo -h -N -p debug -o '%N %T' 2>/dev/null || true)
    s1=$(awk '$1=="n1"{print $2}' <<<"$states")
    s2=$(awk '$1=="n2"{print $2}' <<<"$states")
    ok=1
    for s in "$s1" "$s2"; do
        [[ $s =~ ^(idle|mixed|allocated|completing)$ ]] || ok=0
    done
    # A slurmd that daemonized and then died (port taken, ...) leaves its node looking idle to
    # slurmctld for minutes: require each new slurmd to be alive and to have registered.
    for node in "${fresh[@]}"; do
        [[ -f $STATE/run/slurmd.$node.pid ]] && ! alive "$STATE/run/slurmd.$node.pid" slurmd \
            && fail "slurmd -N $node died after starting"
        t=$(timeout 5 scontrol show node -o "$node" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2 || true)
        (( $(date -d "$t" +%s 2>/dev/null || echo 0) >= started_at )) || ok=0
    done
    ((ok)) && break
    if ((SECONDS - resumed_at >= 3)); then
        bad=()
        [[ $s1 =~ (down|drain|fail) ]] && bad+=(n1)
        [[ $s2 =~ (down|drain|fail) ]] && bad+=(n2)
        if ((${#bad[@]})); then
            say "nodes n1='$s1' n2='$s2' (left from an earlier run?): scontrol update NodeName=$(IFS=,; echo "${bad[*]}") State=RESUME"
            timeout 10 scontrol update NodeName="$(IFS=,; echo "${bad[*]}")" State=RESUME >/dev/null 2>&1 || true
            resumed_at=$SECONDS
        fi
    fi
    ((SECONDS < deadline)) || fail "nodes not up after ${WAIT_S}s: n1='$s1' n2='$s2' (new slurmd: ${fresh[*]:-none})"
    sleep 0.2
done

say "cluster up: n1=$s1 n2=$s2 (state in $STATE)"
echo "export SLURM_CONF=$CONF"
