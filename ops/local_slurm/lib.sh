# Helpers shared by start.sh and stop.sh (sourced, not run).
STATE=${PRISM_SLURM_DIR:-/tmp/prism-slurm}
SLURM_CONF_DIR=${PRISM_SLURM_CONF_DIR:-/etc/slurm}  # Slurm's default folder: every client finds it

log() { echo "local_slurm: $*" >&2; }
die() {
  echo "local_slurm: error: $*" >&2
  exit 1
}

# alive PIDFILE COMM: the pid in PIDFILE runs (not a zombie) and is really COMM (pids wrap).
alive() {
  local pid stat
  [ -s "$1" ] || return 1
  pid=$(tr -dc 0-9 <"$1" 2>/dev/null)
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  stat=${stat##*) }  # the field after "(comm) " is the state letter
  [ "${stat%% *}" != Z ] && [ "${stat%% *}" != X ]
}

# wait_for NAME SECONDS CMD...: poll CMD every 0.2 s; on timeout print log tails and fail.
wait_for() {
  local name=$1 limit=$2
  shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail_logs
      die "$name did not come up within $limit s (check: $*); logs above"
    fi
    sleep 0.2
  done
}

munge_ok() { munge -n | unmunge; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

tail_logs() {
  local f
  for f in "$STATE"/log/*.log; do
    [ -f "$f" ] || continue
    echo "--- $f" >&2
    tail -n 15 "$f" >&2
  done
}

# stop_daemon NAME [COMM]: TERM the daemon recorded in $STATE/run/NAME.pid (only if it is the program COMM,
# default NAME), wait, then KILL.
stop_daemon() {
  local name=${2:-$1} pidfile="$STATE/run/$1.pid" pid i
  if ! alive "$pidfile" "$name"; then
    rm -f "$pidfile"
    return 0
  fi
  pid=$(tr -dc 0-9 <"$pidfile" 2>/dev/null)
  [ -n "$pid" ] || return 0  # the daemon removed its pid file while exiting
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 100); do
    alive "$pidfile" "$name" || break
    sleep 0.1
  done
  if alive "$pidfile" "$name"; then
    log "$name (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
  log "stopped $1 (pid $pid)"
}

# stop_slurmds: every slurmd this host runs for the cluster (run/slurmd-NODE.pid; run/slurmd.pid is the
# one-node layout of older start.sh versions).
stop_slurmds() {
  local f
  for f in "$STATE"/run/slurmd-*.pid "$STATE/run/slurmd.pid"; do
    [ -e "$f" ] || continue
    f=${f##*/}
    stop_daemon "${f%.pid}" slurmd
  done
}
