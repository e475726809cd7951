#!/usr/bin/env bash
# Start a single-node SLURM cluster on this machine, for the SLURM executor's live tests.
#
# Idempotent: installs Debian's slurm-wlm and munge when missing, creates the munge key when
# missing, (re)starts munged, slurmctld and `slurmd -N localhost` by hand (these machines have no
# systemd), and returns once `sinfo` shows the node up and a `sbatch --wrap hostname` job has
# completed. Running it again with the daemons up and the same configuration does nothing but
# that final check. Must be run as root.
#
# The node: the real CPU topology and RealMemory a little below the machine's (slurmd drains a
# node whose RealMemory exceeds what it finds), two fake GPUs (gres backed by device nodes that no
# driver serves, so that SLURM allocates them and sets CUDA_VISIBLE_DEVICES), KillWait=2 so that a time-limit or
# scancel escalation takes seconds, and kill_invalid_depend so that a job whose afterok dependency
# failed is cancelled instead of pending forever.
#
# Environment knobs: SLURM_START_TIMEOUT_S (default 60: how long to wait for the node and the
# check job), SLURM_MIN_JOB_AGE (default 30: seconds slurmctld keeps a finished job's record).
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
GRES_CONF=$CONF_DIR/gres.conf
FAKE_GPU_DIR=/dev/shm/evalsched-fake-gpus
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
CTLD_PID=$RUN_DIR/slurmctld.pid
SLURMD_PID=$RUN_DIR/slurmd.pid
MUNGE_KEY=/etc/munge/munge.key
MUNGE_SOCKET_DIR=/run/munge
MUNGE_PID=$MUNGE_SOCKET_DIR/munged.pid
TIMEOUT_S=${SLURM_START_TIMEOUT_S:-60}
MIN_JOB_AGE=${SLURM_MIN_JOB_AGE:-30}

t0=$(date +%s.%N)
say() { printf 'start_slurm: %s\n' "$*"; }
die() {
  printf 'start_slurm: ERROR: %s\n' "$*" >&2
  for log in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log"; do
    if [ -s "$log" ] && [ -r "$log" ]; then
      printf '  --- last lines of %s ---\n' "$log" >&2
      tail -n 15 "$log" | sed 's/^/  /' >&2
    fi
  done
  exit 1
}
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts system daemons)"

# ---------------------------------------------------------------- packages
missing=()
command -v munged >/dev/null 2>&1 || missing+=(munge)
for bin in slurmctld slurmd sbatch; do
  command -v "$bin" >/dev/null 2>&1 || { missing+=(slurm-wlm); break; }
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed"
  # --no-install-recommends: the recommends pull in mail tools and documentation, minutes here.
  # The postinst scripts try to start services through invoke-rc.d; without systemd they fail
  # harmlessly or are skipped (policy-rc.d is not ours to change).
  apt-get install -y -qq --no-install-recommends munge slurm-wlm >/dev/null \
    || die "apt-get install munge slurm-wlm failed"
  say "installed in $(elapsed) s"
else
  say "munge and slurm-wlm already installed"
fi
id munge >/dev/null 2>&1 || die "the munge package did not create the 'munge' user"

# ---------------------------------------------------------------- munge
if [ ! -s "$MUNGE_KEY" ]; then
  say "creating $MUNGE_KEY"
  mkdir -p "$(dirname "$MUNGE_KEY")"
  if command -v mungekey >/dev/null 2>&1; then
    mungekey --create --keyfile="$MUNGE_KEY" --force >/dev/null || die "mungekey failed"
  else
    dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none || die "cannot write $MUNGE_KEY"
  fi
fi
chown munge:munge "$MUNGE_KEY" && chmod 0400 "$MUNGE_KEY"
mkdir -p "$MUNGE_SOCKET_DIR" /var/lib/munge /var/log/munge
chown munge:munge "$MUNGE_SOCKET_DIR" /var/lib/munge /var/log/munge
chmod 0711 "$MUNGE_SOCKET_DIR"  # munged refuses a socket directory others can write to

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if munge_ok; then
  say "munged already running"
else
  # A stale pid file or socket from a killed munged makes the new one refuse to start.
  if [ -s "$MUNGE_PID" ] && kill -0 "$(cat "$MUNGE_PID")" 2>/dev/null; then
    die "munged (pid $(cat "$MUNGE_PID")) is running but does not answer"
  fi
  rm -f "$MUNGE_PID" "$MUNGE_SOCKET_DIR/munge.socket.2" "$MUNGE_SOCKET_DIR/munge.socket.2.lock"
  say "starting munged"
  runuser -u munge -- munged || die "munged did not start (see /var/log/munge/munged.log)"
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  munge_ok || die "munged started but 'munge -n | unmunge' fails"
fi

# ---------------------------------------------------------------- configuration
# The node's real topology (slurmd -C), so that slurmd does not drain it as inconsistent.
hw=$(slurmd -C 2>/dev/null | head -n 1) || die "slurmd -C failed"
field() { sed -n "s/.*[[:space:]]$1=\([0-9]*\).*/\1/p" <<<"$hw"; }
cpus=$(field CPUs); boards=$(field Boards); sockets=$(field SocketsPerBoard)
cores=$(field CoresPerSocket); threads=$(field ThreadsPerCore); mem=$(field RealMemory)
if [ -z "$cpus" ] || [ -z "$mem" ]; then die "cannot read the CPU count and memory from 'slurmd -C': $hw"; fi
# A little below the machine's memory: 95%, and at least 512 MB less.
real_mem=$(( mem * 95 / 100 ))
[ $(( mem - real_mem )) -ge 512 ] || real_mem=$(( mem - 512 ))
[ "$real_mem" -gt 0 ] || die "too little memory: $mem MB"
def_mem=$(( real_mem / cpus / 2 ))  # two jobs' default memory per CPU fit on each CPU
topology="CPUs=$cpus"
if [ -n "$boards" ] && [ -n "$sockets" ] && [ -n "$cores" ] && [ -n "$threads" ]; then
  topology="$topology Boards=$boards SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads"
fi

mkdir -p "$CONF_DIR" "$STATE_DIR" "$SPOOL_DIR" "$LOG_DIR" "$RUN_DIR" "$FAKE_GPU_DIR"
# Fake GPUs: slurmd accepts only character or block devices in gres.conf (a plain file is logged
# as "not a valid character or block device" and then SLURM sets no CUDA_VISIBLE_DEVICES). Major
# 240 is in the range Linux reserves for local/experimental use: opening these nodes gives ENXIO,
# and nothing ever does (TaskPlugin=task/none confines nothing).
for i in 0 1; do
  node="$FAKE_GPU_DIR/fakegpu$i"
  if [ ! -c "$node" ]; then
    rm -f "$node"
    mknod -m 0600 "$node" c 240 "$i" || die "cannot create the fake GPU device $node (mknod)"
  fi
done

new_conf=$(mktemp)
new_gres=$(mktemp)
trap 'rm -f "$new_conf" "$new_gres"' EXIT
cat >"$new_conf" <<EOF
# Written by jupyter_evalsched's scripts/start_slurm.sh: a single-node cluster for tests.
ClusterName=evalsched
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: processes are tracked by process group; no task confinement.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=kill_invalid_depend
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$def_mem
# Seconds between SIGTERM and SIGKILL at a time limit or scancel.
KillWait=2
# Seconds a finished job's record stays in slurmctld (squeue/scontrol can see its end state).
MinJobAge=$MIN_JOB_AGE
# A node that registers with a valid configuration comes back up by itself (after a restart).
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
Waittime=0
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 $topology RealMemory=$real_mem Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
cat >"$new_gres" <<EOF
# Fake GPUs: device nodes that no driver serves. SLURM allocates them and sets CUDA_VISIBLE_DEVICES.
NodeName=localhost Name=gpu File=$FAKE_GPU_DIR/fakegpu[0-1]
EOF

changed=0
if ! cmp -s "$new_conf" "$CONF" || ! cmp -s "$new_gres" "$GRES_CONF"; then
  changed=1
  install -m 0644 "$new_conf" "$CONF"
  install -m 0644 "$new_gres" "$GRES_CONF"
  say "wrote $CONF and $GRES_CONF (node: $topology RealMemory=$real_mem Gres=gpu:2)"
else
  say "$CONF unchanged"
fi

# ---------------------------------------------------------------- daemons
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop() {  # stop the daemon whose pid file is $1 (only that pid), waiting for it to exit
  local pid
  alive "$1" || return 0
  pid=$(cat "$1")
  say "stopping $2 (pid $pid): the configuration changed"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}
if [ "$changed" = 1 ]; then
  stop "$SLURMD_PID" slurmd
  stop "$CTLD_PID" slurmctld
fi

if alive "$CTLD_PID"; then
  say "slurmctld already running (pid $(cat "$CTLD_PID"))"
else
  say "starting slurmctld"
  slurmctld || die "slurmctld did not start"
fi
for _ in $(seq "$(( TIMEOUT_S * 5 ))"); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
scontrol ping 2>/dev/null | grep -q 'is UP' || die "slurmctld does not answer 'scontrol ping'"

if alive "$SLURMD_PID"; then
  say "slurmd already running (pid $(cat "$SLURMD_PID"))"
else
  say "starting slurmd -N localhost"
  slurmd -N localhost || die "slurmd did not start"
fi

# ---------------------------------------------------------------- wait for the node, then a job
deadline=$(( $(date +%s) + TIMEOUT_S ))
state=
while [ "$(date +%s)" -lt "$deadline" ]; do
  state=$(sinfo --noheader --nodes=localhost --format=%T 2>/dev/null | head -n 1)
  case "$state" in
    idle|mixed|allocated|completing) break ;;
    drained|draining|down|drain*|*fail*)
      # e.g. left down by an earlier run; one resume, then it must register cleanly.
      scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true ;;
  esac
  sleep 0.2
done
case "$state" in
  idle|mixed|allocated|completing) say "node localhost is $state" ;;
  *) die "node localhost is '${state:-not listed}' after ${TIMEOUT_S} s: $(scontrol show node localhost 2>&1 | grep -o 'Reason=.*' || true)" ;;
esac

remaining=$(( deadline - $(date +%s) )); [ "$remaining" -ge 10 ] || remaining=10
out=$(timeout "$remaining" sbatch --wait --parsable --time=1 --output=/dev/null --job-name=start-slurm-check \
  --wrap hostname 2>&1) || die "the check job 'sbatch --wait --wrap hostname' did not complete: $out"
say "check job $out completed"
say "SLURM is up in $(elapsed) s"
