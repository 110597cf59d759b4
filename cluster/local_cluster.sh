#!/usr/bin/env bash
# Run: cluster/local_cluster.sh start [--workers 2] [--cpus 2] [--dir DIR]
#      source DIR/env      # RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH, GTI_DASHBOARD, GTI_CLUSTER_DIR
#      gti run --config jobs/configs/tiny.yaml ray_address=auto ground.num_workers=2 \
#          'ground.resources_per_worker={CPU: 1, gti_worker: 1}'
#      cluster/local_cluster.sh stop [--dir DIR]   # DIR: --dir, else $GTI_CLUSTER_DIR (set by DIR/env)
#
# A multi-node Ray cluster on one machine, for tests and for trying multi-node behaviour on a
# laptop: a head and N worker nodes, each a `ray start --block` process. Every worker node
# carries the custom resources `gti_worker: 1` and `gti_node_<i>: 1`, so a Train run that asks
# for `gti_worker: 1` per worker is forced to put each worker on a different node.
#
# The cluster folder DIR holds the pids `stop` kills, the token and the `env` file you source,
# so it must be yours alone: `start` without --dir (and without $GTI_CLUSTER_DIR) makes a fresh
# private one (mktemp -d, mode 700) and prints it; a DIR you name is created with mode 700, and
# an existing one that is a symlink, is not owned by you or lets group/others in (mode not
# 700) is refused by every command before anything is read or written (a predictable
# /tmp folder could be made first by another local user, who could then read the token, plant
# the `env` file, or point `stop`'s kill and rm at their choice).
#
# Token authentication is on: a random token is written to <dir>/auth_token (mode 600) and
# every node and client reads it through RAY_AUTH_TOKEN_PATH (nothing touches ~/.ray).
# The dashboard listens on 127.0.0.1 only.
#
# `stop` ends exactly the processes this script started, by the pids it recorded, with SIGTERM
# (each `ray start --block` then tears down the raylet, GCS and workers it started). It never
# calls `ray stop`, which would kill every Ray on the machine, including other users' clusters.
# A process still running GTI_STOP_GRACE_S seconds (default 10) after SIGTERM gets SIGKILL, and
# so do any of their children (noted before the SIGTERM) that outlive them.
set -euo pipefail

cmd="${1:-}"
shift || true
WORKERS=2
CPUS=2
DIR="${GTI_CLUSTER_DIR:-}"
TIMEOUT=90
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers) WORKERS="$2"; shift 2 ;;
    --cpus) CPUS="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    *) echo "local_cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

# The folder must be this user's alone (see the top): refuse anything else before using it.
private_dir() {
  local d="$1" mode
  if [[ -L "$d" ]]; then
    echo "local_cluster.sh: refusing cluster folder $d: it is a symlink (give a real folder of yours)" >&2; exit 2
  fi
  if [[ ! -e "$d" ]]; then
    mkdir -p "$(dirname "$d")"
    mkdir -m 700 "$d"  # fails (and so does the script) if someone made it meanwhile
    return 0
  fi
  if [[ ! -d "$d" ]]; then
    echo "local_cluster.sh: refusing cluster folder $d: not a folder" >&2; exit 2
  fi
  if [[ ! -O "$d" ]]; then
    echo "local_cluster.sh: refusing cluster folder $d: owned by $(ls -ld "$d" | awk '{print $3}'), not by you" >&2
    exit 2
  fi
  mode="$(stat -c %a "$d" 2>/dev/null || stat -f %Lp "$d")"
  if (( (8#$mode & 8#077) != 0 )); then
    echo "local_cluster.sh: refusing cluster folder $d: mode $mode lets other users in (chmod 700 $d, or omit --dir for a fresh private one)" >&2
    exit 2
  fi
}

if [[ -z "$DIR" ]]; then
  case "$cmd" in
    start) DIR="$(mktemp -d "${TMPDIR:-/tmp}/gti-cluster.XXXXXX")" ;;  # mode 700, a name no one can guess
    stop|status)
      echo "local_cluster.sh: which cluster? pass --dir DIR (printed by start) or set GTI_CLUSTER_DIR (DIR/env sets it)" >&2
      exit 2 ;;
  esac
elif [[ -e "$DIR" || -L "$DIR" || "$cmd" == start ]]; then
  private_dir "$DIR"
fi
if [[ -d "$DIR" ]]; then DIR="$(cd "$DIR" && pwd -P)"; fi

RAY_BIN="${RAY_BIN:-$(command -v ray || true)}"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
PIDS="$DIR/pids"

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Ports every node would otherwise take by default; two nodes on one machine must not share them.
node_ports() {
  echo "--dashboard-agent-listen-port=$(free_port) --dashboard-agent-grpc-port=$(free_port)" \
       "--metrics-export-port=$(free_port) --runtime-env-agent-port=$(free_port)"
}

start() {
  if [[ -z "$RAY_BIN" ]]; then
    echo "local_cluster.sh: 'ray' not found on PATH (activate the project venv)" >&2; exit 2
  fi
  if [[ -s "$PIDS" ]]; then
    echo "local_cluster.sh: $DIR already has a cluster (pids in $PIDS); stop it first" >&2; exit 2
  fi
  echo "local_cluster.sh: cluster folder $DIR"
  mkdir -p "$DIR/logs"
  : > "$PIDS"
  # Short temp dir: Ray's socket paths must stay under the 107-byte AF_UNIX limit.
  local tmp; tmp="$(mktemp -d /tmp/gtiray.XXXXXX)"
  echo "$tmp" > "$DIR/temp_dir"
  umask 077
  "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$DIR/auth_token"
  umask 022
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$DIR/auth_token" RAY_USAGE_STATS_ENABLED=0
  # RAY_AUTH_TOKEN would win over the token file (e.g. inherited from a gti process that ran its
  # own private local Ray, gti.ray_start), and Ray's single-machine mode (=0 there; the
  # default on macOS) would make the worker nodes refuse to start.
  unset RAY_AUTH_TOKEN
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1

  local port dash
  port="$(free_port)"; dash="$(free_port)"
  # shellcheck disable=SC2046
  "$RAY_BIN" start --head --block --port="$port" --num-cpus="$CPUS" \
    --dashboard-host=127.0.0.1 --dashboard-port="$dash" --ray-client-server-port="$(free_port)" \
    --temp-dir="$tmp" --resources='{"gti_head": 1}' --disable-usage-stats $(node_ports) \
    > "$DIR/logs/head.log" 2>&1 &
  echo "$!" >> "$PIDS"

  # Workers can join only once the head's GCS answers.
  wait_nodes "127.0.0.1:$port" 1
  local i
  for ((i = 1; i <= WORKERS; i++)); do
    # shellcheck disable=SC2046
    # Each node its own temp dir, as on separate machines: nodes sharing one session folder
    # share its runtime_resources/, where one node's runtime-env agent deleted and re-extracted a
    # job's working_dir under the running driver of another (its cwd gone, torch's MKL then
    # failed to load: tests/e2e/test_multinode.py).
    "$RAY_BIN" start --block --address="127.0.0.1:$port" --num-cpus="$CPUS" --temp-dir="$tmp/node_$i" \
      --resources="{\"gti_worker\": 1, \"gti_node_$i\": 1}" --disable-usage-stats $(node_ports) \
      > "$DIR/logs/worker_$i.log" 2>&1 &
    echo "$!" >> "$PIDS"
    # One node at a time: a raylet must register with the GCS within 30 s, which several
    # nodes starting together on a busy 2-core machine can miss.
    wait_nodes "127.0.0.1:$port" $((i + 1))
  done

  cat > "$DIR/env" <<EOF
export RAY_ADDRESS=127.0.0.1:$port
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$DIR/auth_token
export GTI_DASHBOARD=http://127.0.0.1:$dash
export GTI_CLUSTER_DIR=$DIR
EOF
  echo "local_cluster.sh: head + $WORKERS workers up; address 127.0.0.1:$port, dashboard http://127.0.0.1:$dash"
  echo "local_cluster.sh: source $DIR/env to use it; stop with: $0 stop --dir $DIR"
}

# Wait until `want` nodes are alive, or fail (and clean up) after TIMEOUT seconds.
wait_nodes() {
  local address="$1" want="$2"
  if ! "$PYTHON" - "$address" "$want" "$TIMEOUT" <<'EOF'
import sys, time
import ray
address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.time() + timeout
while True:
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        break
    except Exception:
        if time.time() > deadline:
            sys.exit(f"head at {address} did not answer within {timeout:.0f}s")
        time.sleep(1)
while sum(n["Alive"] for n in ray.nodes()) < want:
    if time.time() > deadline:
        sys.exit(f"only {sum(n['Alive'] for n in ray.nodes())}/{want} nodes alive after {timeout:.0f}s")
    time.sleep(0.5)
EOF
  then
    echo "local_cluster.sh: cluster did not come up; logs in $DIR/logs" >&2
    stop
    exit 1
  fi
}

# A pid still runs: it exists and is not a zombie (an exited `ray start` whose parent, when the
# starting shell is gone, has not reaped it yet).
running() {
  local st; st="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  [[ -n "$st" && "$st" != Z* ]]
}

descendants() {  # every descendant pid of the given pids, depth first
  local p k
  for p in "$@"; do
    for k in $(pgrep -P "$p" 2>/dev/null); do echo "$k"; descendants "$k"; done
  done
}

# SIGTERM to the given pids; whatever is still running after $2 half-seconds gets SIGKILL.
term_then_kill() {
  local pids="$1" limit="$2" pid waited=0
  for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in $pids; do
    while running "$pid" && [[ $waited -lt $limit ]]; do sleep 0.5; waited=$((waited + 1)); done
    if running "$pid"; then
      echo "local_cluster.sh: pid $pid ($(ps -o args= -p "$pid" 2>/dev/null | cut -c1-60)) still running" \
        "$((waited / 2)) s after SIGTERM; sending SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}

stop() {
  if [[ ! -s "$PIDS" ]]; then
    echo "local_cluster.sh: no cluster recorded in $DIR"; return 0
  fi
  # Workers first (reverse order), then the head. Their children (raylet, GCS, dashboard and
  # its modules, workers) are noted first: a `ray start --block` that hangs on shutdown and
  # needs SIGKILL would otherwise leave them running.
  local pids; pids="$(tac "$PIDS")"
  # shellcheck disable=SC2086
  local tree; tree="$(descendants $pids)"
  local grace=$((2 * ${GTI_STOP_GRACE_S:-10}))  # half-seconds each group may take after SIGTERM
  term_then_kill "$pids" "$grace"
  local left="" pid
  for pid in $tree; do running "$pid" && left="$left $pid"; done
  if [[ -n "$left" ]]; then term_then_kill "$left" "$grace"; fi
  : > "$PIDS"
  if [[ -s "$DIR/temp_dir" ]]; then
    # Ray's helper processes (raylet, GCS, log monitor) may still be flushing logs into the
    # session folder for a moment after the processes above exit: retry for up to 10 s.
    local tdir tries=0; tdir="$(cat "$DIR/temp_dir")"
    until rm -rf "$tdir" 2>/dev/null || [[ $tries -ge 20 ]]; do sleep 0.5; tries=$((tries + 1)); done
    if [[ -e "$tdir" ]]; then echo "local_cluster.sh: warning: could not remove $tdir" >&2; fi
  fi
  rm -f "$DIR/env" "$DIR/temp_dir" "$DIR/auth_token"
  echo "local_cluster.sh: stopped"
}

status() {
  if [[ ! -s "$PIDS" ]]; then echo "local_cluster.sh: no cluster recorded in $DIR"; return 1; fi
  local pid
  for pid in $(cat "$PIDS"); do
    if running "$pid"; then echo "$pid alive"; else echo "$pid gone"; fi
  done
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status [--workers N] [--cpus C] [--dir DIR] [--timeout S]" >&2; exit 2 ;;
esac
