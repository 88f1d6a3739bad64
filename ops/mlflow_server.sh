#!/usr/bin/env bash
# Start / stop / check one real `mlflow server` that every training job logs to over http
# (many jobs writing one SQLite file directly hit "database is locked"; the server serialises them).
#
#   ops/mlflow_server.sh start [--auth]|stop|status
#
# --auth runs MLflow's basic-auth app: every request needs a user, and a user sees only the experiments it was
# granted (default permission NO_PERMISSIONS). The admin password and the Flask secret key are read from files
# of mode 0600 and reach the server through its environment only (never its command line, which `ps` shows).
#
# Settings (environment):
#   MLFLOW_SERVER_DIR    folder for mlflow.db, artifacts/, server.pid, server.log   (default runs/mlflow-server)
#   MLFLOW_SERVER_HOST   bind address (default 127.0.0.1: only this machine can reach it)
#   MLFLOW_SERVER_PORT   port (default 5000)
#   MLFLOW_ALLOWED_HOSTS Host headers to accept when bound elsewhere (default: <hostname>:<port>,
#                        <fqdn>:<port>, <ip>:<port>, localhost:<port>); MLflow >= 3.5 refuses others
#   MLFLOW_SERVER_WAIT   seconds to wait for /health on start (default 90)
#   MLFLOW               the mlflow executable (default: .venv/bin/mlflow if present, else mlflow)
# With --auth:
#   MLFLOW_ADMIN_PASSWORD_FILE  the admin's password, mode 0600 (default $MLFLOW_SERVER_DIR/admin-password);
#                               MLflow takes it on the first start only, when it creates the admin user
#   MLFLOW_SECRET_KEY_FILE      the Flask secret key, mode 0600 (default $MLFLOW_SERVER_DIR/secret-key)
#   MLFLOW_ADMIN_USER           the admin's name (default admin)
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
APPFILE="$DIR/server.app" # which app the running server is: plain or basic-auth
PASSWORD_FILE=${MLFLOW_ADMIN_PASSWORD_FILE:-$DIR/admin-password}
SECRET_FILE=${MLFLOW_SECRET_KEY_FILE:-$DIR/secret-key}
ADMIN=${MLFLOW_ADMIN_USER:-admin}
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

secret_file() {
  # A secret readable by its owner alone: a regular file of mode 0600 (or 0400), owned by us, not empty.
  local what=$1 file=$2 setting=$3 mode
  [ -f "$file" ] || die "--auth needs the $what in a file: $file does not exist; create it with mode 0600 (umask 077) or set $setting"
  mode=$(stat -c %a "$file")
  case "$mode" in 600 | 400) ;; *) die "$file (the $what) has mode $mode, readable by others; run 'chmod 600 $file'" ;; esac
  [ "$(stat -c %u "$file")" = "$(id -u)" ] || die "$file (the $what) belongs to another user; create your own or set $setting"
  [ -s "$file" ] || die "$file (the $what) is empty; write the $what into it"
}

auth_config() {
  # The basic-auth app's config: nobody sees anything unless granted; the user database beside the store.
  # No password in it: the admin's comes from MLFLOW_AUTH_ADMIN_PASSWORD in the server's environment.
  # Checking a password costs a scrypt hash (0.1-0.7 s of CPU) per request, and every logged step is a
  # request: a checked password is remembered for 60 s. With one worker a password change or a deleted
  # user through the API takes effect at once all the same (MLflow drops the entry).
  local dir_abs=$1
  printf '%s\n' "[mlflow]" "default_permission = NO_PERMISSIONS" "database_uri = sqlite:///$dir_abs/basic_auth.db" \
    "admin_username = $ADMIN" "authorization_function = mlflow.server.auth:authenticate_request_basic_auth" \
    "auth_cache_ttl_seconds = 60" >"$dir_abs/basic_auth.ini.tmp"
  mv "$dir_abs/basic_auth.ini.tmp" "$dir_abs/basic_auth.ini"
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
  local app=plain
  case "${1:-}" in
    "") ;;
    --auth) app=basic-auth ;;
    *) die "unknown option '$1' for start; the only one is --auth" ;;
  esac
  [ $# -le 1 ] || die "start takes one option (--auth), got: $*"
  if pid=$(running_pid); then
    local running_app
    running_app=$(cat "$APPFILE" 2>/dev/null || echo plain)
    [ "$running_app" = "$app" ] || die "a server (pid $pid) is running as '$running_app', not '$app'; run '$0 stop' first"
    healthy || die "a server (pid $pid) from $PIDFILE is running but $URL/health does not answer; see $LOG or run '$0 stop'"
    ours "$pid" || die "pid $pid from $PIDFILE is alive but does not hold port $PORT; run '$0 stop' and start again"
    echo "mlflow_server: already running (pid $pid) at $URL"
    return 0
  fi
  command -v "$MLFLOW" >/dev/null || die "mlflow executable '$MLFLOW' not found; run 'make setup' or set MLFLOW"
  port_free || die "port $PORT on $HOST is already in use by another process (another mlflow server?); stop it or set MLFLOW_SERVER_PORT"
  if [ "$app" = basic-auth ]; then
    [[ $ADMIN =~ ^[A-Za-z0-9._@-]+$ ]] || die "MLFLOW_ADMIN_USER=$(printf %q "$ADMIN") is not a user name (letters, digits, . _ @ -)"
    secret_file "admin password" "$PASSWORD_FILE" MLFLOW_ADMIN_PASSWORD_FILE
    secret_file "Flask secret key" "$SECRET_FILE" MLFLOW_SECRET_KEY_FILE
  fi
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
  if [ "$app" = basic-auth ]; then
    auth_config "$dir_abs"
    args+=(--app-name basic-auth)
    MLFLOW_AUTH_CONFIG_PATH="$dir_abs/basic_auth.ini" MLFLOW_AUTH_ADMIN_PASSWORD=$(<"$PASSWORD_FILE") \
      MLFLOW_FLASK_SERVER_SECRET_KEY=$(<"$SECRET_FILE") setsid "$MLFLOW" "${args[@]}" >>"$LOG" 2>&1 </dev/null &
  else
    setsid "$MLFLOW" "${args[@]}" >>"$LOG" 2>&1 </dev/null &
  fi
  local pid=$!
  echo "$pid" >"$PIDFILE.tmp" && mv "$PIDFILE.tmp" "$PIDFILE"
  echo "$app" >"$APPFILE"
  local t=0
  until healthy && ours "$pid"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$PIDFILE" "$APPFILE"
      die "server exited during start-up (port $PORT taken by another process?); last log line: $(tail -n 1 "$LOG")"
    fi
    if [ "$t" -ge "$WAIT" ]; then
      stop >/dev/null
      die "no answer from $URL/health after ${WAIT}s; see $LOG or raise MLFLOW_SERVER_WAIT"
    fi
    sleep 1
    t=$((t + 1))
  done
  echo "mlflow_server: running (pid $pid, $app) at $URL, store $dir_abs/mlflow.db, log $LOG"
}

stop() {
  local pid
  if ! pid=$(running_pid); then
    rm -f "$PIDFILE" "$APPFILE"
    echo "mlflow_server: not running"
    return 0
  fi
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$PIDFILE" "$APPFILE"
  echo "mlflow_server: stopped (pid $pid)"
}

status() {
  if pid=$(running_pid) && healthy && ours "$pid"; then
    echo "mlflow_server: running (pid $pid, $(cat "$APPFILE" 2>/dev/null || echo plain)) at $URL"
  else
    echo "mlflow_server: not running ($URL)"
    return 1
  fi
}

case "$cmd" in
  start) start "${@:2}" ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: $0 start [--auth]|stop|status (settings via MLFLOW_SERVER_DIR/HOST/PORT, see the header)" ;;
esac
