#!/usr/bin/env bash
# Start a real Slurm cluster on this machine: munged, slurmctld and two slurmd "nodes" (n1, n2)
# sharing this host. Idempotent: what already runs is left alone, so running it again is quick.
#
#   bash slurm/local/up.sh            # then: export SLURM_CONF=/tmp/launcher-slurm/slurm.conf
#   bash slurm/local/down.sh [--wipe]
#
# State (slurm.conf, gres.conf, spool, state, logs, pid files) lives in ${LAUNCHER_SLURM_STATE:-/tmp/launcher-slurm}.
# Each node has ${LAUNCHER_SLURM_GPUS:-2} fake GPUs (GRES gpu; 0: none): character devices
# /dev/launcher-fake-gpu<i> that nothing opens, so jobs asking for GPUs get CUDA_VISIBLE_DEVICES set
# the way a real cluster sets it, while torch still sees no GPU. When slurm.conf or gres.conf changes,
# daemons already running are restarted (running jobs go on); when nothing changed, nothing is.
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
# One up.sh at a time (two test sessions starting together): a restart must not race a start.
# Daemons are started with fd 9 closed, so they do not hold the lock.
exec 9>"$STATE/run/up.lock"
flock -w 120 9 || { echo "up.sh: another up.sh has held $STATE/run/up.lock for 120 s" >&2; exit 1; }
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

# --- fake GPUs --------------------------------------------------------------------------------
# GRES File= must name a character or block device (a regular file makes slurmd fail with "is not
# a valid character or block device"): mknod with NVIDIA's major number 195, minor i, mode 666.
# Node n1 gets gpu0..gpu{G-1}, n2 gpu{G}..gpu{2G-1}: distinct files, so a job's GPUs tell its node.
GPUS=${LAUNCHER_SLURM_GPUS:-2}
[[ $GPUS =~ ^[0-9]+$ ]] || { echo "up.sh: LAUNCHER_SLURM_GPUS=$GPUS is not a number" >&2; exit 2; }
for ((i = 0; i < 2 * GPUS; i++)); do
    dev=/dev/launcher-fake-gpu$i
    [[ -c $dev && $(stat -c '%t:%T' "$dev") == "c3:$(printf '%x' "$i")" ]] && continue
    rm -f "$dev"
    if ! mknod -m 666 "$dev" c 195 "$i" 2>"$STATE/log/mknod.err"; then
        say "mknod $dev failed ($(head -c 200 "$STATE/log/mknod.err")): nodes get no GPUs"
        GPUS=0
        break
    fi
done
gres_line() {  # gres_line NODE FIRST: gres.conf's line for NODE, GPUs FIRST..FIRST+GPUS-1
    if ((GPUS == 1)); then
        echo "NodeName=$1 Name=gpu File=/dev/launcher-fake-gpu$2"
    else
        echo "NodeName=$1 Name=gpu File=/dev/launcher-fake-gpu[$2-$(($2 + GPUS - 1))]"
    fi
}

# --- configuration ----------------------------------------------------------------------------
HOST=$(hostname -s)
chmod 755 "$STATE"
if ((GPUS > 0)); then
    GRES_TYPES=$'\nGresTypes=gpu'
    NODE_GRES=" Gres=gpu:$GPUS"
else
    GRES_TYPES=""
    NODE_GRES=""
fi

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
MailProg=/bin/true${GRES_TYPES}
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=2 RealMemory=4000${NODE_GRES} State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=2 RealMemory=4000${NODE_GRES} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
# gres.conf: slurmctld and slurmd read it from slurm.conf's folder (the -f file's, or SLURM_CONF's).
GRES_CONF=$STATE/gres.conf
new_gres="# Written by slurm/local/up.sh; rewritten on every run. Fake GPUs: see up.sh."
if ((GPUS > 0)); then
    new_gres+=$'\n'"AutoDetect=off"$'\n'"$(gres_line n1 0)"$'\n'"$(gres_line n2 "$GPUS")"
fi
write_if_changed() {  # write_if_changed FILE CONTENT
    if [[ ! -f $1 ]] || [[ $(cat "$1") != "$2" ]]; then
        printf '%s\n' "$2" >"$1"
    fi
}
write_if_changed "$CONF" "$new_conf"
write_if_changed "$GRES_CONF" "$new_gres"
# The two files as the running daemons read them when they started (written below, once they are
# started). Daemons started from other files (changed since, or started by an older up.sh or by
# hand) are restarted: GresTypes and the nodes' Gres take effect only then, `scontrol reconfigure`
# leaves the nodes without GPUs.
STARTED=$STATE/run/started-with.conf
want=$(cat "$CONF" "$GRES_CONF")

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
    timeout 20 runuser -u munge -- /usr/sbin/munged --force 9>&- || fail "munged did not start"
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || fail "munge -n | unmunge fails"
fi

# Daemons started from other files: stop slurmd n1, n2 and slurmctld (SIGTERM, together; ~1 s) to
# start them again below. Jobs keep running through it (their slurmstepd stays); so does their state.
if [[ ! -f $STARTED ]] || [[ $(cat "$STARTED") != "$want" ]]; then
    pids=()
    for name in slurmd.n1:slurmd slurmd.n2:slurmd slurmctld:slurmctld; do
        if alive "$STATE/run/${name%%:*}.pid" "${name#*:}"; then
            pids+=("$(<"$STATE/run/${name%%:*}.pid")")
        fi
    done
    if ((${#pids[@]})); then
        say "configuration changed since the daemons started: restarting slurmctld and slurmd (pids ${pids[*]})"
        kill -TERM "${pids[@]}" 2>/dev/null || true
        for _ in $(seq 150); do
            live=0
            for pid in "${pids[@]}"; do if kill -0 "$pid" 2>/dev/null; then live=1; fi; done
            ((live)) || break
            sleep 0.1
        done
        for pid in "${pids[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then say "pid $pid ignored SIGTERM for 15 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
        done
    fi
fi

# slurmctld
if ! alive "$STATE/run/slurmctld.pid" slurmctld; then
    say "starting slurmctld"
    timeout 30 slurmctld -f "$CONF" 9>&- || fail "slurmctld did not start"
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
        timeout 30 slurmd -f "$CONF" -N "$node" 9>&- || fail "slurmd -N $node did not start"
    fi
done
[[ -f $STARTED ]] && [[ $(cat "$STARTED") == "$want" ]] || printf '%s\n' "$want" >"$STARTED"

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
