#!/usr/bin/env bash
# A local "cluster" on loopback: one Ray head (token auth on, dashboard on 127.0.0.1) and an
# MLflow tracking server (SQLite backend, artifacts on local disk, proxied by the server).
#
#   infra/local/cluster.sh start | stop | status | env
#
# Everything it starts runs in two process groups whose leaders' pids are kept in the state dir;
# `stop` ends exactly those (and any process still holding this Ray temp dir), never other Ray or
# MLflow instances on the machine, which is why it does not call `ray stop` (that kills every Ray
# process of every user session on the host).
#
# Environment (all optional):
#   BERTPIPE_LOCAL_DIR        state dir (pid files, logs, Ray temp dir, MLflow db + artifacts);
#                             default: <repo>/.bertpipe-local
#   BERTPIPE_RAY_TOKEN_FILE   token file; generated (0600) if absent; default ~/.ray/auth_token,
#                             Ray's own default, so clients on this machine need only RAY_AUTH_MODE
#   BERTPIPE_RAY_PORT         GCS port (default 6379); the head's other ports are derived from it:
#                             +1 node manager, +2 object manager, +3/+4 dashboard agent http/grpc,
#                             +5 metrics, +6 runtime-env agent, +7 Ray Client, +100..+299 workers
#   BERTPIPE_DASHBOARD_PORT   dashboard / Jobs API (default 8265)
#   BERTPIPE_MLFLOW_PORT      MLflow server (default 5000)
#   BERTPIPE_NUM_CPUS         logical CPUs Ray schedules on (default 4: trainer workers each take
#                             one, and Ray Data tasks need free CPUs or the input pipeline stalls)
#   BERTPIPE_NUM_GPUS         GPUs to advertise (default: Ray's autodetection)
#   BERTPIPE_START_TIMEOUT    seconds to wait for each service to become healthy (default 120)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE_DIR="${BERTPIPE_LOCAL_DIR:-$REPO/.bertpipe-local}"
TOKEN_FILE="${BERTPIPE_RAY_TOKEN_FILE:-$HOME/.ray/auth_token}"
RAY_PORT="${BERTPIPE_RAY_PORT:-6379}"
DASHBOARD_PORT="${BERTPIPE_DASHBOARD_PORT:-8265}"
MLFLOW_PORT="${BERTPIPE_MLFLOW_PORT:-5000}"
NUM_CPUS="${BERTPIPE_NUM_CPUS:-4}"
NUM_GPUS="${BERTPIPE_NUM_GPUS:-}"
START_TIMEOUT="${BERTPIPE_START_TIMEOUT:-120}"
# Absolute paths: start_ray changes directory, and pid files must mean the same thing to `stop`.
case "$STATE_DIR" in /*) ;; *) STATE_DIR="$PWD/$STATE_DIR" ;; esac
case "$TOKEN_FILE" in /*) ;; *) TOKEN_FILE="$PWD/$TOKEN_FILE" ;; esac

RAY_TMP="$STATE_DIR/ray"
RAY_PID="$STATE_DIR/ray.pid"
RAY_LOG="$STATE_DIR/ray.log"
MLFLOW_DIR="$STATE_DIR/mlflow"
MLFLOW_PID="$STATE_DIR/mlflow.pid"
MLFLOW_LOG="$STATE_DIR/mlflow.log"
ENV_FILE="$STATE_DIR/env.sh"
DASHBOARD_URL="http://127.0.0.1:$DASHBOARD_PORT"
MLFLOW_URL="http://127.0.0.1:$MLFLOW_PORT"

# Use the repo's virtual environment when ray/mlflow are not on PATH already.
if ! command -v ray >/dev/null 2>&1 && [ -x "$REPO/.venv/bin/ray" ]; then
    PATH="$REPO/.venv/bin:$PATH"
fi

log() { echo "[cluster.sh] $*" >&2; }
die() { log "error: $*"; exit 1; }

is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }

proc_alive() {  # pid -> 0 if running (an unreaped zombie does not count)
    local stat
    stat="$(ps -o stat= -p "$1" 2>/dev/null)" && [ -n "$stat" ] && [[ "$stat" != Z* ]]
}

pid_alive() {  # pid file -> 0 if its process is alive
    [ -f "$1" ] && proc_alive "$(cat "$1")"
}

http_code() {  # url [curl args...] -> HTTP status ("000" when nothing answers)
    local url="$1"; shift
    curl -s -o /dev/null -m 5 -w '%{http_code}' "$@" "$url" || true
}

port_busy() {  # bash's /dev/tcp: no dependency on ss/lsof/nc
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

spawn_detached() {  # log file, command... -> starts it as a new session (own process group), prints pid
    local logfile="$1"; shift
    # setsid(2) through Python: util-linux `setsid` is missing on macOS, Python is always here.
    # (setsid fails only for a process-group leader, which a background job of this script is not.)
    nohup python3 -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' "$@" \
        >"$logfile" 2>&1 </dev/null &
    echo $!
}

wait_healthy() {  # name, pid file, url, log -> waits until url answers 200 while the pid lives
    local name="$1" pidfile="$2" url="$3" logfile="$4" deadline=$((SECONDS + START_TIMEOUT))
    until [ "$(http_code "$url")" = 200 ]; do
        if ! pid_alive "$pidfile"; then
            log "$name exited during start-up; last lines of $logfile:"
            tail -n 20 "$logfile" >&2 || true
            return 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$name not healthy after ${START_TIMEOUT}s at $url; last lines of $logfile:"
            tail -n 20 "$logfile" >&2 || true
            return 1
        fi
        sleep 0.5
    done
}

group_alive() {  # pgid -> 0 while a live (non-zombie) process is in that group
    ps -A -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'
}

kill_group() {  # pid file, grace seconds -> TERM the leader, wait, then KILL what is left of its group
    local pidfile="$1" grace="$2" pid n=0
    [ -f "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    if proc_alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        while proc_alive "$pid" && [ "$n" -lt $((grace * 4)) ]; do sleep 0.25; n=$((n + 1)); done
    fi
    # The leader made its own session, so its pid is the process group id of everything it spawned.
    if group_alive "$pid"; then
        kill -TERM -- "-$pid" 2>/dev/null || true
        n=0
        while group_alive "$pid" && [ "$n" -lt 20 ]; do sleep 0.25; n=$((n + 1)); done
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

ensure_token() {
    if [ -s "$TOKEN_FILE" ]; then return 0; fi
    mkdir -p "$(dirname "$TOKEN_FILE")"
    # 32 random bytes, hex: the same strength `ray get-auth-token --generate` uses.
    (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32), end="")' >"$TOKEN_FILE")
    chmod 600 "$TOKEN_FILE"   # an empty file that was there already keeps its mode through the redirect
    log "generated a Ray auth token in $TOKEN_FILE"
}

print_env() {
    # Two addresses because Ray takes two kinds: the Jobs API wants the dashboard URL (ray job *,
    # JobSubmissionClient, bertpipe submit read RAY_API_SERVER_ADDRESS first), while a driver's
    # ray.init() and `ray status` want the GCS address and refuse an http:// RAY_ADDRESS.
    cat <<EOF
export RAY_API_SERVER_ADDRESS=$DASHBOARD_URL
export RAY_ADDRESS=127.0.0.1:$RAY_PORT
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
export MLFLOW_TRACKING_URI=$MLFLOW_URL
EOF
}

start_ray() {
    if pid_alive "$RAY_PID"; then log "Ray head already running (pid $(cat "$RAY_PID"))"; return 0; fi
    ensure_token
    mkdir -p "$RAY_TMP"
    local args=(ray start --head --block --disable-usage-stats
        --temp-dir "$RAY_TMP" --num-cpus "$NUM_CPUS"
        --port "$RAY_PORT" --node-manager-port $((RAY_PORT + 1)) --object-manager-port $((RAY_PORT + 2))
        --dashboard-agent-listen-port $((RAY_PORT + 3)) --dashboard-agent-grpc-port $((RAY_PORT + 4))
        --metrics-export-port $((RAY_PORT + 5)) --runtime-env-agent-port $((RAY_PORT + 6))
        --min-worker-port $((RAY_PORT + 100)) --max-worker-port $((RAY_PORT + 299))
        --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT")
    # The Ray Client server needs ray[client]; ask for a fixed port only where it can start.
    if python3 -c 'import grpc' 2>/dev/null; then args+=(--ray-client-server-port $((RAY_PORT + 7))); fi
    if [ -n "$NUM_GPUS" ]; then args+=(--num-gpus "$NUM_GPUS"); fi
    # The token file is the single source: an RAY_AUTH_TOKEN inherited from the shell would win over it.
    # Jobs submitted without a working_dir run in the directory `ray start` ran in: the repo root, so
    # `bertpipe run --config configs/tiny.yaml` resolves as it does in the image's WORKDIR.
    cd "$REPO"
    # No drain on stop: Ray's SIGTERM handler otherwise waits up to 30 s for the node to drain (made for Serve
    # replicas behind a load balancer); after a training job that made `stop` take 33 s instead of 3.
    # RAY_timeout_ms_task_wait_for_death_info, RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S: as on every node of the
    # project's clusters (bertpipe.jobs.cluster.NODE_ENV).
    spawn_detached "$RAY_LOG" env -u RAY_AUTH_TOKEN RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$TOKEN_FILE" \
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 \
        RAY_timeout_ms_task_wait_for_death_info="${RAY_timeout_ms_task_wait_for_death_info:-0}" \
        RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="${RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S:-1}" \
        "${args[@]}" >"$RAY_PID"
    log "starting Ray head (pid $(cat "$RAY_PID"), log $RAY_LOG)"
    # /api/gcs_healthz is one of the dashboard paths Ray leaves open without a token.
    wait_healthy "Ray head" "$RAY_PID" "$DASHBOARD_URL/api/gcs_healthz" "$RAY_LOG"
}

start_mlflow() {
    if pid_alive "$MLFLOW_PID"; then log "MLflow already running (pid $(cat "$MLFLOW_PID"))"; return 0; fi
    mkdir -p "$MLFLOW_DIR/artifacts"
    # --artifacts-destination: the server proxies artifact uploads, so Ray workers need only the
    # tracking URI, as on a real cluster. Job execution (GenAI evaluation jobs) is off: unused here,
    # and it forks seven huey consumers on a two-core machine.
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false spawn_detached "$MLFLOW_LOG" \
        mlflow server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
        --backend-store-uri "sqlite:///$MLFLOW_DIR/mlflow.db" \
        --artifacts-destination "$MLFLOW_DIR/artifacts" >"$MLFLOW_PID"
    log "starting MLflow server (pid $(cat "$MLFLOW_PID"), log $MLFLOW_LOG)"
    wait_healthy "MLflow server" "$MLFLOW_PID" "$MLFLOW_URL/health" "$MLFLOW_LOG"
}

cmd_start() {
    for v in RAY_PORT DASHBOARD_PORT MLFLOW_PORT NUM_CPUS START_TIMEOUT; do
        is_int "${!v}" || die "$v must be an integer, got '${!v}'"
    done
    command -v ray >/dev/null || die "ray not found: activate the project's virtual environment"
    command -v mlflow >/dev/null || die "mlflow not found: activate the project's virtual environment"
    # All ports first, so that a busy one stops the start before anything is spawned.
    local p
    if ! pid_alive "$RAY_PID"; then
        for p in "$RAY_PORT" $((RAY_PORT + 1)) $((RAY_PORT + 2)) $((RAY_PORT + 3)) $((RAY_PORT + 4)) \
                 $((RAY_PORT + 5)) $((RAY_PORT + 6)) $((RAY_PORT + 7)) "$DASHBOARD_PORT"; do
            port_busy "$p" && die "port $p is in use; set BERTPIPE_RAY_PORT / BERTPIPE_DASHBOARD_PORT"
        done
    fi
    if ! pid_alive "$MLFLOW_PID"; then
        port_busy "$MLFLOW_PORT" && die "port $MLFLOW_PORT is in use; set BERTPIPE_MLFLOW_PORT"
    fi
    mkdir -p "$STATE_DIR"
    local t0=$SECONDS
    if ! start_ray || ! start_mlflow; then
        log "start failed; stopping what was started"
        cmd_stop >/dev/null 2>&1 || true
        exit 1
    fi
    print_env >"$ENV_FILE"
    cat <<EOF
Ray dashboard: $DASHBOARD_URL  (token in $TOKEN_FILE; the browser asks for it once)
MLflow:        $MLFLOW_URL
Ready in $((SECONDS - t0)) s. For clients (bertpipe submit, ray job submit, JobSubmissionClient), run:
$(print_env)
(or: source $ENV_FILE)
EOF
}

cmd_stop() {
    kill_group "$MLFLOW_PID" 15
    # Ray's SIGTERM handler ends its children, a second or so each (no drain: start_ray).
    kill_group "$RAY_PID" 40
    # Workers or agents that escaped the process group still name this temp dir on their command
    # line; nothing else on the machine does.
    local pids
    pids="$(pgrep -f -- "$RAY_TMP/" || true)"
    if [ -n "$pids" ]; then
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
    fi
    rm -f "$ENV_FILE"
    log "stopped"
}

cmd_status() {
    local rc=0 code
    if pid_alive "$RAY_PID"; then
        code="$(http_code "$DASHBOARD_URL/api/gcs_healthz")"
        echo "ray:    running (pid $(cat "$RAY_PID")), dashboard $DASHBOARD_URL health=$code"
        [ "$code" = 200 ] || rc=3
    else
        echo "ray:    stopped"; rc=3
    fi
    if pid_alive "$MLFLOW_PID"; then
        code="$(http_code "$MLFLOW_URL/health")"
        echo "mlflow: running (pid $(cat "$MLFLOW_PID")), $MLFLOW_URL health=$code"
        [ "$code" = 200 ] || rc=3
    else
        echo "mlflow: stopped"; rc=3
    fi
    return "$rc"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) print_env ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
