#!/usr/bin/env bash
# Start a real one-node Slurm cluster on this host (munge, MariaDB + slurmdbd for accounting, slurmctld,
# slurmd) without systemd, then wait until the node takes jobs. Idempotent: daemons that already run
# with the same config are kept; a changed config restarts slurmctld + slurmd. Safe to call from
# parallel test workers (one lock). Stop with ops/local_slurm/stop.sh (ends only what this started).
#
# Environment:
#   PRISM_SLURM_DIR         state, spool, logs, pid files, MariaDB datadir   (default /tmp/prism-slurm)
#   PRISM_SLURM_CPUS        task slots of the node; more than the cores oversubscribes on purpose
#                           (default: the real CPU count)
#   PRISM_SLURM_ACCOUNTING  1 = slurmdbd + MariaDB (sacct works; submitit's result() of killed or
#                           timed-out jobs returns instead of hanging), 0 = none          (default 1)
#   PRISM_SLURM_TIMEOUT     seconds to wait for each daemon / the idle node               (default 60)
# Needs root (it writes /etc/slurm and runs the daemons as root).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=ops/local_slurm/lib.sh
source "$HERE/lib.sh"

CPUS=${PRISM_SLURM_CPUS:-$(nproc)}
ACCOUNTING=${PRISM_SLURM_ACCOUNTING:-1}
TIMEOUT=${PRISM_SLURM_TIMEOUT:-60}
[ "$(id -u)" -eq 0 ] || die "must run as root (it writes $SLURM_CONF_DIR and starts the daemons)"
[[ "$CPUS" =~ ^[0-9]+$ ]] && [ "$CPUS" -ge 1 ] || die "PRISM_SLURM_CPUS=$CPUS is not a positive integer"

mkdir -p "$STATE/run" "$STATE/log" "$STATE/ctld" "$STATE/spool"
exec 9>"$STATE/start.lock"  # daemons start with 9>&- so they never hold the lock
flock -w 300 9 || die "another start.sh holds $STATE/start.lock for more than 300 s"

# --- packages -------------------------------------------------------------------------------------
need=()
command -v slurmctld >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
if [ "$ACCOUNTING" = 1 ]; then
  command -v slurmdbd >/dev/null || need+=(slurmdbd)
  command -v mariadbd >/dev/null || need+=(mariadb-server)
fi
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq "${need[@]}" >/dev/null \
    || die "apt-get install ${need[*]} failed; install them by hand"
fi

# --- munge: reuse one that answers, else start ours ----------------------------------------------
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- munged --force 9>&-
  wait_for "munged" "$TIMEOUT" munge_ok
  cp /run/munge/munged.pid "$STATE/run/munged.pid"  # marks it as ours for stop.sh
  log "munged started (pid $(cat "$STATE/run/munged.pid"))"
fi

# --- config ----------------------------------------------------------------------------------------
HOST=$(hostname -s)
read -r sockets cores threads mem < <(slurmd -C | awk '
  /NodeName/ { for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] } }
  END { print (v["SocketsPerBoard"] ? v["SocketsPerBoard"] : v["Sockets"]), v["CoresPerSocket"], v["ThreadsPerCore"], v["RealMemory"] }')
real_cpus=$((sockets * cores * threads))
if [ "$CPUS" -eq "$real_cpus" ]; then
  topology="Sockets=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads"
  overrides=""
else  # more (or fewer) slots than cores: slurmd must trust the config, not the hardware
  topology="Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1"
  overrides="SlurmdParameters=config_overrides"
fi
if [ "$ACCOUNTING" = 1 ]; then
  storage="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1"
else
  storage="AccountingStorageType=accounting_storage/none"
fi

new_conf=$(cat <<EOF
# Written by ops/local_slurm/start.sh: one node bound to this host (loopback).
ClusterName=prism
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job restarts after cred_expire; the default 120 s would stall every requeue test.
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
# Memory is not consumable: jobs without --mem do not take the whole node.
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
ReturnToService=2
MinJobAge=300
KillWait=30
$storage
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
$overrides
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS $topology RealMemory=$((mem * 9 / 10)) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
mkdir -p "$SLURM_CONF_DIR"
conf_changed=0
if [ ! -f "$SLURM_CONF_DIR/slurm.conf" ] || [ "$(cat "$SLURM_CONF_DIR/slurm.conf")" != "$new_conf" ]; then
  printf '%s\n' "$new_conf" >"$SLURM_CONF_DIR/slurm.conf.tmp"
  mv "$SLURM_CONF_DIR/slurm.conf.tmp" "$SLURM_CONF_DIR/slurm.conf"
  conf_changed=1
fi

# --- accounting: private MariaDB on 127.0.0.1:3307, then slurmdbd ----------------------------------
if [ "$ACCOUNTING" = 1 ]; then
  DB="$STATE/mariadb"
  SOCK="$STATE/run/mariadb.sock"
  if ! alive "$STATE/run/mariadbd.pid" mariadbd; then
    if [ ! -d "$DB/mysql" ]; then
      rm -rf "$DB.tmp"
      mariadb-install-db --no-defaults --user=root --datadir="$DB.tmp" --auth-root-authentication-method=socket \
        >"$STATE/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $STATE/log/mariadb-install.log"
      mv "$DB.tmp" "$DB"
    fi
    setsid mariadbd --no-defaults --user=root --datadir="$DB" --bind-address=127.0.0.1 --port=3307 \
      --socket="$SOCK" --pid-file="$STATE/run/mariadbd.pid" --log-error="$STATE/log/mariadb.log" \
      --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 9>&- &
    wait_for "mariadbd" "$TIMEOUT" mariadb --no-defaults -S "$SOCK" -u root -e "select 1"
    log "mariadbd started (pid $(cat "$STATE/run/mariadbd.pid"))"
  fi
  mariadb --no-defaults -S "$SOCK" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'prism-slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"

  new_dbd=$(cat <<EOF
# Written by ops/local_slurm/start.sh
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StoragePass=prism-slurm
StorageLoc=slurm_acct_db
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
EOF
)
  if [ ! -f "$SLURM_CONF_DIR/slurmdbd.conf" ] || [ "$(cat "$SLURM_CONF_DIR/slurmdbd.conf")" != "$new_dbd" ]; then
    (umask 077 && printf '%s\n' "$new_dbd" >"$SLURM_CONF_DIR/slurmdbd.conf.tmp")
    mv "$SLURM_CONF_DIR/slurmdbd.conf.tmp" "$SLURM_CONF_DIR/slurmdbd.conf"
    stop_daemon slurmdbd
  fi
  if ! alive "$STATE/run/slurmdbd.pid" slurmdbd; then
    slurmdbd 9>&-
    wait_for "slurmdbd" "$TIMEOUT" port_open 6819
    log "slurmdbd started (pid $(cat "$STATE/run/slurmdbd.pid"))"
  fi
fi

# --- slurmctld + slurmd ------------------------------------------------------------------------------
if [ "$conf_changed" = 1 ]; then  # both daemons must re-read a changed slurm.conf
  stop_daemon slurmd
  stop_daemon slurmctld
fi
if ! alive "$STATE/run/slurmctld.pid" slurmctld; then
  slurmctld 9>&-
  wait_for "slurmctld" "$TIMEOUT" scontrol ping
  log "slurmctld started (pid $(cat "$STATE/run/slurmctld.pid"))"
fi
if ! alive "$STATE/run/slurmd.pid" slurmd; then
  slurmd 9>&-
  wait_for "slurmd" "$TIMEOUT" test -s "$STATE/run/slurmd.pid"
  log "slurmd started (pid $(cat "$STATE/run/slurmd.pid"))"
fi

# --- wait until the node takes jobs ---------------------------------------------------------------
deadline=$((SECONDS + TIMEOUT))
while :; do
  state=$(sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -1)
  case "$state" in
    idle | mixed | allocated) break ;;
    down* | drain* | drained*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
  esac
  if [ "$SECONDS" -ge "$deadline" ]; then
    tail_logs
    die "node $HOST is '${state:-unknown}' after ${TIMEOUT} s, not idle; logs above"
  fi
  sleep 0.2
done
log "cluster up: node $HOST $state, $CPUS CPUs, accounting=$ACCOUNTING, state in $STATE"
