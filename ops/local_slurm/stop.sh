#!/usr/bin/env bash
# Stop the local Slurm cluster that ops/local_slurm/start.sh started. Ends only the daemons whose pid
# files start.sh's daemons wrote under $PRISM_SLURM_DIR (checked against /proc/PID/comm), never by
# name; a munged that was already running before start.sh is left alone. Idempotent.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=ops/local_slurm/lib.sh
source "$HERE/lib.sh"
[ -d "$STATE/run" ] || exit 0
exec 9>"$STATE/start.lock"
flock -w 300 9 || die "another start.sh/stop.sh holds $STATE/start.lock"
stop_slurmds
for name in slurmctld slurmdbd mariadbd munged; do
  stop_daemon "$name"
done
