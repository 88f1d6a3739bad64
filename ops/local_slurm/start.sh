#!/usr/bin/env bash
# Start a real Slurm cluster of one or more nodes on this host (munge, MariaDB + slurmdbd for accounting,
# slurmctld, one slurmd per node) without systemd, then wait until every node takes jobs. Several nodes on
# one machine are Slurm's `slurmd -N NAME`: each node has its own name, port, spool, pid and log file, and
# all bind to loopback. Idempotent: daemons that already run
# with the same config are kept; a changed config restarts slurmctld + slurmd. Safe to call from
# parallel test workers (one lock). Stop with ops/local_slurm/stop.sh (ends only what this started).
#
# Environment:
#   PRISM_SLURM_DIR         state, spool, logs, pid files, MariaDB datadir   (default /tmp/prism-slurm)
#   PRISM_SLURM_NODES       number of nodes (default 1). 1: one node named after this host, as before;
#                           N > 1: nodes prism1..prismN, slurmd ports 6818, 6821, 6822, ... (6819 is slurmdbd)
#   PRISM_SLURM_CPUS        task slots per node, one number for every node or a comma list, one per node
#                           ("4,2"); more than the cores oversubscribes on purpose (default: the real CPU count)
#   PRISM_SLURM_ACCOUNTING  1 = slurmdbd + MariaDB (sacct works; submitit's result() of killed or
#                           timed-out jobs returns instead of hanging), 0 = none          (default 1)
#   PRISM_SLURM_TIMEOUT     seconds to wait for each daemon / the idle node               (default 60)
# Needs root (it writes /etc/slurm and runs the daemons as root).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=ops/local_slurm/lib.sh
source "$HERE/lib.sh"

NODES=${PRISM_SLURM_NODES:-1}
CPUS=${PRISM_SLURM_CPUS:-$(nproc)}
ACCOUNTING=${PRISM_SLURM_ACCOUNTING:-1}
TIMEOUT=${PRISM_SLURM_TIMEOUT:-60}
[ "$(id -u)" -eq 0 ] || die "must run as root (it writes $SLURM_CONF_DIR and starts the daemons)"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "PRISM_SLURM_NODES=$NODES is not a positive integer"
IFS=, read -r -a node_cpus <<<"$CPUS"
[ "${#node_cpus[@]}" -eq 1 ] || [ "${#node_cpus[@]}" -eq "$NODES" ] \
  || die "PRISM_SLURM_CPUS=$CPUS lists ${#node_cpus[@]} CPU counts for $NODES nodes; give one, or one per node"
for c in "${node_cpus[@]}"; do
  [[ "$c" =~ ^[1-9][0-9]*$ ]] || die "PRISM_SLURM_CPUS=$CPUS: '$c' is not a positive integer"
done

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
names=()
node_lines=""
overrides=""
for i in $(seq "$NODES"); do
  cpus=${node_cpus[$(((i - 1) % ${#node_cpus[@]}))]}
  if [ "$NODES" -eq 1 ]; then
    name=$HOST port=6818
  else
    name=prism$i port=$((i == 1 ? 6818 : 6819 + i))
  fi
  names+=("$name")
  if [ "$NODES" -eq 1 ] && [ "$cpus" -eq "$real_cpus" ]; then
    topology="Sockets=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads"
  else  # fake nodes, or more (or fewer) slots than cores: slurmd must trust the config, not the hardware
    topology="Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1"
    overrides="SlurmdParameters=config_overrides"
  fi
  node_lines+="NodeName=$name NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=$cpus $topology"
  node_lines+=" RealMemory=$((mem * 9 / 10 / NODES)) State=UNKNOWN"$'\n'
done
if [ "$ACCOUNTING" = 1 ]; then
  storage="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1"
else
  storage="AccountingStorageType=accounting_storage/none"
fi

new_conf=$(cat <<EOF
# Written by ops/local_slurm/start.sh: $NODES node(s) on this host, bound to loopback.
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
# %n = the node's name: every slurmd of this host has its own spool, pid and log file.
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
$overrides
${node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
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
  stop_slurmds
  stop_daemon slurmctld
fi
if ! alive "$STATE/run/slurmctld.pid" slurmctld; then
  slurmctld 9>&-
  wait_for "slurmctld" "$TIMEOUT" scontrol ping
  log "slurmctld started (pid $(cat "$STATE/run/slurmctld.pid"))"
fi
for name in "${names[@]}"; do
  pidfile="$STATE/run/slurmd-$name.pid"
  if ! alive "$pidfile" slurmd; then
    mkdir -p "$STATE/spool/$name"
    slurmd -N "$name" 9>&-
    wait_for "slurmd -N $name" "$TIMEOUT" test -s "$pidfile"
    log "slurmd $name started (pid $(cat "$pidfile"))"
  fi
done

# --- wait until every node takes jobs -------------------------------------------------------------
deadline=$((SECONDS + TIMEOUT))
for name in "${names[@]}"; do
  while :; do
    state=$(sinfo -h -N -n "$name" -o %T 2>/dev/null | head -1)
    case "$state" in
      idle | mixed | allocated) break ;;
      down* | drain* | drained*) scontrol update nodename="$name" state=resume 2>/dev/null || true ;;
    esac
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail_logs
      die "node $name is '${state:-unknown}' after ${TIMEOUT} s, not idle; logs above"
    fi
    sleep 0.2
  done
done
log "cluster up: $NODES node(s) ${names[*]}, CPUs $CPUS, accounting=$ACCOUNTING, state in $STATE"
