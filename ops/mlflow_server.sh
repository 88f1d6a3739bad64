#!/usr/bin/env bash
# Start / stop / check one real `mlflow server` that every training job logs to over http
# (many jobs writing one SQLite file directly hit "database is locked"; the server serialises them).
#
#   ops/mlflow_server.sh start|stop|status
#
# Settings (environment):
#   MLFLOW_SERVER_DIR    folder for mlflow.db, artifacts/, server.pid, server.log   (default runs/mlflow-server)
#   MLFLOW_SERVER_HOST   bind address (default 127.0.0.1: only this machine can reach it)
#   MLFLOW_SERVER_PORT   port (default 5000)
#   MLFLOW_ALLOWED_HOSTS Host headers to accept when bound elsewhere (default: <hostname>:<port>,
#                        <fqdn>:<port>, <ip>:<port>, localhost:<port>); MLflow >= 3.5 refuses others
#   MLFLOW_SERVER_WAIT   seconds to wait for /health on start (default 90)
#   MLFLOW               the mlflow executable (default: .venv/bin/mlflow if present, else mlflow)
set -euo pipefail

cmd=${1:-}
DIR=${MLFLOW_SERVER_DIR:-runs/mlflow-server}
HOST=${MLFLOW_SERVER_HOST:-127.0.0.1}
PORT=${MLFLOW_SERVER_PORT:-5000}
WAIT=${MLFLOW_SERVER_WAIT:-90}
here=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${MLFLOW:-}" ]; then
  if [ -x "$here/.venv/bin/mlflow" ]; then MLFLOW="$here/.venv/bin/mlflow"; else MLFLOW=mlflow; fi
fi
PIDFILE="$DIR/server.pid"
LOG="$DIR/server.log"
# Clients on this machine reach a 0.0.0.0 bind through loopback.
case "$HOST" in 0.0.0.0 | "::") CLIENT_HOST=127.0.0.1 ;; *) CLIENT_HOST=$HOST ;; esac
URL="http://$CLIENT_HOST:$PORT"

die() { echo "mlflow_server: error: $*" >&2; exit 2; }

running_pid() {
  [ -f "$PIDFILE" ] || return 1
  local pid
  pid=$(cat "$PIDFILE")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

healthy() {
  # /health answers "OK" once the app is serving; python is always here, curl may not be.
  "${PYTHON:-python3}" - "$URL/health" <<'EOF' 2>/dev/null
import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
}

port_free() {
  # Can we bind HOST:PORT? (SO_REUSEADDR like the server, so a closed socket in TIME_WAIT does not count)
  "${PYTHON:-python3}" - "$HOST" "$PORT" <<'EOF' 2>/dev/null
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind((sys.argv[1], int(sys.argv[2])))
except OSError:
    sys.exit(1)
EOF
}

ours() {
  # Does the process group we started (setsid: session id = pid) hold the listening socket on PORT? A health
  # answer alone may come from another server already on the port, while ours dies seconds later.
  "${PYTHON:-python3}" - "$1" "$PORT" <<'EOF' 2>/dev/null
import os, sys
sid, port = int(sys.argv[1]), int(sys.argv[2])
inodes = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        rows = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for row in rows:
        f = row.split()
        if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
            inodes.add(f"socket:[{f[9]}]")
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[3]) != sid:  # field 6: session
            continue
        if any(os.readlink(f"/proc/{p}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{p}/fd")):
            sys.exit(0)
    except OSError:
        continue
sys.exit(1)
EOF
}

start() {
  if pid=$(running_pid); then
    healthy || die "a server (pid $pid) from $PIDFILE is running but $URL/health does not answer; see $LOG or run '$0 stop'"
    ours "$pid" || die "pid $pid from $PIDFILE is alive but does not hold port $PORT; run '$0 stop' and start again"
    echo "mlflow_server: already running (pid $pid) at $URL"
    return 0
  fi
  command -v "$MLFLOW" >/dev/null || die "mlflow executable '$MLFLOW' not found; run 'make setup' or set MLFLOW"
  port_free || die "port $PORT on $HOST is already in use by another process (another mlflow server?); stop it or set MLFLOW_SERVER_PORT"
  mkdir -p "$DIR/artifacts"
  local dir_abs
  dir_abs=$(cd "$DIR" && pwd)
  local args=(server --backend-store-uri "sqlite:///$dir_abs/mlflow.db"
    --artifacts-destination "$dir_abs/artifacts" --serve-artifacts
    --host "$HOST" --port "$PORT" --workers 1)
  case "$HOST" in
    127.0.0.1 | localhost | ::1) ;;
    *)
      local fq ip
      fq=$(hostname -f 2>/dev/null || hostname)
      ip=$(hostname -I 2>/dev/null | awk '{print $1}')
      args+=(--allowed-hosts "${MLFLOW_ALLOWED_HOSTS:-$(hostname):$PORT,$fq:$PORT${ip:+,$ip:$PORT},localhost:$PORT,127.0.0.1:$PORT}")
      ;;
  esac
  # Own session (setsid) so `stop` can end the server and its workers as one process group.
  setsid "$MLFLOW" "${args[@]}" >>"$LOG" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$PIDFILE.tmp" && mv "$PIDFILE.tmp" "$PIDFILE"
  local t=0
  until healthy && ours "$pid"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$PIDFILE"
      die "server exited during start-up (port $PORT taken by another process?); last log line: $(tail -n 1 "$LOG")"
    fi
    if [ "$t" -ge "$WAIT" ]; then
      stop >/dev/null
      die "no answer from $URL/health after ${WAIT}s; see $LOG or raise MLFLOW_SERVER_WAIT"
    fi
    sleep 1
    t=$((t + 1))
  done
  echo "mlflow_server: running (pid $pid) at $URL, store $dir_abs/mlflow.db, log $LOG"
}

stop() {
  local pid
  if ! pid=$(running_pid); then
    rm -f "$PIDFILE"
    echo "mlflow_server: not running"
    return 0
  fi
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$PIDFILE"
  echo "mlflow_server: stopped (pid $pid)"
}

status() {
  if pid=$(running_pid) && healthy && ours "$pid"; then
    echo "mlflow_server: running (pid $pid) at $URL"
  else
    echo "mlflow_server: not running ($URL)"
    return 1
  fi
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: $0 start|stop|status (settings via MLFLOW_SERVER_DIR/HOST/PORT, see the header)" ;;
esac
