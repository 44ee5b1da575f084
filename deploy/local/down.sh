#!/usr/bin/env bash
# Stop what deploy/local/up.sh started, in reverse order: the planner first (it drains and stops
# the workers it started), then the router, the workers, the server. Each gets SIGTERM (vLLM
# workers flush their kvtier store; the server flushes DRAM-only blocks), SIGKILL after a grace.
set -uo pipefail
RUN_DIR=${RUN_DIR:-./kvtier-local}
GRACE_S=${GRACE_S:-120}

stop() {   # name
  local pidfile="$RUN_DIR/$1.pid" pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq "$GRACE_S"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && { echo "$1 did not stop in $GRACE_S s: SIGKILL"; kill -KILL -- "-$pid" 2>/dev/null; }
  fi
  rm -f "$pidfile"
  echo "stopped $1"
}

stop planner
stop router
for f in "$RUN_DIR"/worker-*.pid; do [ -e "$f" ] && stop "$(basename "$f" .pid)"; done
stop server
