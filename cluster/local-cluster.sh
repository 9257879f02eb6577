#!/usr/bin/env bash
# A Ray cluster of one head and N worker nodes on this one machine, for trying zeroray's
# multi-node behaviour (placement strategies, job submission) without a real cluster.
#
#   bash cluster/local-cluster.sh up       # start, wait until every node is alive
#   bash cluster/local-cluster.sh status   # the cluster's nodes and resources
#   bash cluster/local-cluster.sh down     # stop exactly the processes `up` started
#   bash cluster/local-cluster.sh env      # print the exports a job client needs
#   bash cluster/local-cluster.sh add-node worker3    # one more worker node (fault tests)
#   bash cluster/local-cluster.sh kill-node worker1   # lose a node: SIGKILL its process group
#
# Everything lives under one directory (ZR_CLUSTER_DIR): the auth token, the Ray temp
# dirs, the logs and one pgid file per node. Each `ray start --block` runs in its own
# session (setsid), so `down` can signal exactly those process groups; it never runs
# `ray stop`, which would stop every Ray instance of this user on the machine.
#
# Environment (all optional):
#   ZR_CLUSTER_DIR        state directory         (/tmp/zeroray-cluster-$USER)
#   ZR_HEAD_PORT          GCS port of the head    (6479; Ray's default is 6379)
#   ZR_DASHBOARD_PORT     dashboard / job API     (8275; Ray's default is 8265), on 127.0.0.1
#   ZR_NUM_WORKER_NODES   worker nodes            (2)
#   ZR_NODE_CPUS          logical CPUs per node   (2)
#   ZR_OBJECT_STORE_MB    object store per node   (256)
#   ZR_NODE_IP            node IP address         (Ray's choice: this machine's address;
#                                                  Ray replaces 127.0.0.1 by it anyway)
#   ZR_UP_TIMEOUT         seconds `up` waits for all nodes   (180)
#   ZR_START_ATTEMPTS     tries per node (Ray gives a raylet 30 s to register) (3)
#   ZR_DOWN_TIMEOUT       seconds `down` waits before SIGKILL (30)
#
# [Note: token auth] Ray 2.60 turns on token authentication for `ray start --head` when a
# token can be found (RAY_AUTH_TOKEN, then the file at RAY_AUTH_TOKEN_PATH, then
# ~/.ray/auth_token), and a joining node needs the same token. To stay off the shared
# ~/.ray/auth_token this script writes its own token to $ZR_CLUSTER_DIR/auth_token and
# starts every node with RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<that file>. Processes
# the nodes start (workers, job drivers) inherit both variables. A client outside the
# cluster (`ray job submit`, `ray status`, a driver calling ray.init) needs them as
# well: `eval "$(bash cluster/local-cluster.sh env)"` sets them.
set -euo pipefail

CLUSTER_DIR="${ZR_CLUSTER_DIR:-/tmp/zeroray-cluster-${USER:-$(id -un)}}"
HEAD_PORT="${ZR_HEAD_PORT:-6479}"
DASHBOARD_PORT="${ZR_DASHBOARD_PORT:-8275}"
NUM_WORKER_NODES="${ZR_NUM_WORKER_NODES:-2}"
NODE_CPUS="${ZR_NODE_CPUS:-2}"
OBJECT_STORE_MB="${ZR_OBJECT_STORE_MB:-256}"
NODE_IP="${ZR_NODE_IP:-}"
UP_TIMEOUT="${ZR_UP_TIMEOUT:-180}"
START_ATTEMPTS="${ZR_START_ATTEMPTS:-3}"
DOWN_TIMEOUT="${ZR_DOWN_TIMEOUT:-30}"
PYTHON="${PYTHON:-python}"

TOKEN_FILE="$CLUSTER_DIR/auth_token"
ID_FILE="$CLUSTER_DIR/cluster_id"
PGID_DIR="$CLUSTER_DIR/pgid"
LOG_DIR="$CLUSTER_DIR/logs"
GCS_ADDRESS="${NODE_IP:-127.0.0.1}:$HEAD_PORT"
DASHBOARD_URL="http://127.0.0.1:$DASHBOARD_PORT"

die() { echo "local-cluster: $*" >&2; exit 1; }
log() { echo "local-cluster: $*"; }

node_names() {
    echo head
    local i
    for ((i = 1; i <= NUM_WORKER_NODES; i++)); do echo "worker$i"; done
}

# Ray's temp dir of one node. Short on purpose: Ray puts unix sockets under
# <temp>/session_<date>_<pid>/sockets/, and a unix socket path is at most 107 bytes.
node_temp_dir() {
    case "$1" in
        head) echo "$CLUSTER_DIR/r/h" ;;
        worker*) echo "$CLUSTER_DIR/r/w${1#worker}" ;;
    esac
}

# Every variable a process talking to this cluster needs (see [Note: token auth]).
auth_env() {
    export RAY_AUTH_MODE=token
    export RAY_AUTH_TOKEN_PATH="$TOKEN_FILE"
    # RAY_AUTH_TOKEN outranks RAY_AUTH_TOKEN_PATH; one left over from another cluster
    # would be sent instead of ours.
    unset RAY_AUTH_TOKEN
    unset RAY_ADDRESS
}

# True while the process group has a member that is not a zombie (a zombie is gone,
# only not yet reaped by its parent). Not `ps -g`: procps reads its argument as a
# session id or a group name.
group_alive() {
    ps -eo pgid=,stat= | grep -qE "^ *$1 +[^Z]"
}

# stop_groups PGID...: SIGTERM the groups, SIGKILL what is left after 15 s.
stop_groups() {
    local pgid deadline=$((SECONDS + 15))
    for pgid in "$@"; do kill -TERM -- "-$pgid" 2>/dev/null || true; done
    for pgid in "$@"; do
        while group_alive "$pgid" && ((SECONDS < deadline)); do sleep 0.5; done
        kill -KILL -- "-$pgid" 2>/dev/null || true
    done
}

# pgids of this cluster's nodes whose process group still has a member.
live_pgids() {
    local f pgid
    [[ -d "$PGID_DIR" ]] || return 0
    for f in "$PGID_DIR"/*.pgid; do
        [[ -e "$f" ]] || continue
        pgid="$(cat "$f")"
        if group_alive "$pgid"; then echo "$pgid"; fi
    done
}

# Processes carrying this cluster's marker (ZR_LOCAL_CLUSTER_ID=<id> in their
# environment, set on the `ray start` commands only and inherited by everything they
# start): Ray gives each worker its own process group and each job driver its own
# session, so those are not hit by the killpg of `down`. They exit on their own once
# their raylet is gone; this lists the stragglers. The id is random per `up`, so no
# process outside the cluster (a shell, this script) carries it.
marked_pids() {
    local f pid id
    [[ -s "$ID_FILE" ]] || return 0
    id="$(cat "$ID_FILE")"
    # grep -z: environ entries are NUL-separated; -x: the whole entry must match.
    for f in $(grep -lzxF -- "ZR_LOCAL_CLUSTER_ID=$id" /proc/[0-9]*/environ 2>/dev/null); do
        pid="${f#/proc/}"
        pid="${pid%/environ}"
        # Zombies hold no environment, so they never match.
        echo "$pid"
    done
}

# wait_gone SECONDS WHAT: true once nothing of WHAT ("groups" or "all") is left.
wait_gone() {
    local deadline=$((SECONDS + $1))
    while true; do
        if [[ -z "$(live_pgids)" ]] && [[ "$2" == groups || -z "$(marked_pids)" ]]; then
            return 0
        fi
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

start_node() {
    local name="$1"
    shift
    local temp_dir log_file pid pgid
    temp_dir="$(node_temp_dir "$name")"
    log_file="$LOG_DIR/$name.log"
    mkdir -p "$temp_dir"
    # setsid: the node gets its own session and process group (pgid = its pid, since a
    # background job of a non-interactive shell is never a group leader already).
    # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: on SIGTERM tear down at once instead of
    # draining for 30 s (draining lets Ray Serve move replicas; nothing to move here).
    # ZR_LOCAL_CLUSTER_ID marks every process of this cluster (see marked_pids).
    ZR_LOCAL_CLUSTER_ID="$(cat "$ID_FILE")" RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 \
        setsid ray start --block \
        ${NODE_IP:+--node-ip-address "$NODE_IP"} \
        --temp-dir "$temp_dir" \
        --num-cpus "$NODE_CPUS" \
        --object-store-memory "$((OBJECT_STORE_MB * 1024 * 1024))" \
        --dashboard-agent-listen-port "$(free_port)" \
        --min-worker-port 0 --max-worker-port 0 \
        --disable-usage-stats \
        "$@" \
        </dev/null >>"$log_file" 2>&1 &
    pid=$!
    # The forked child calls setsid() a moment after `&` returns.
    local tries
    for ((tries = 0; tries < 50; tries++)); do
        pgid="$(ps -o pgid= -p "$pid" | tr -d ' ')" || true
        [[ "$pgid" == "$pid" ]] && break
        sleep 0.1
    done
    if [[ "$pgid" != "$pid" ]]; then
        kill -TERM "$pid" 2>/dev/null || true
        cmd_down >&2 || true
        die "$name: expected pgid $pid, got '${pgid}' (see $log_file)"
    fi
    echo "$pgid" >"$PGID_DIR/$name.pgid"
    log "started $name (pgid $pgid, log $log_file)"
}

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

port_in_use() {
    "$PYTHON" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
# SO_REUSEADDR: a port with only TIME_WAIT connections left is free for Ray (gRPC sets it too).
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("0.0.0.0", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
EOF
}

# Temp dirs of the alive nodes, one a line, asked of the GCS directly (no driver is
# started). A node's raylet socket lives under its temp dir, which names the node here.
alive_node_dirs() {
    "$PYTHON" - "$GCS_ADDRESS" <<'EOF' 2>/dev/null || true
import sys
from ray._raylet import GcsClient
nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5)
for n in nodes.values():
    if n.state == 0:  # ALIVE
        print(n.raylet_socket_name.split("/session_")[0])
EOF
}

node_alive() {
    alive_node_dirs | grep -qxF -- "$(node_temp_dir "$1")"
}

# A node is ready when its raylet is alive; the head also needs the job API up (its
# dashboard can fail to start on its own, which a restart of the head fixes).
node_ready() {
    node_alive "$1" && { [[ "$1" != head ]] || job_api_answers; }
}

# start_node_and_wait NAME ARGS...: start the node and wait until its raylet is alive in
# the GCS. Ray gives a raylet 30 s to register and otherwise gives up (`ray start`
# exits); on a loaded machine that happens, so a node gets START_ATTEMPTS tries.
start_node_and_wait() {
    local name="$1" attempt pgid
    shift
    for ((attempt = 1; attempt <= START_ATTEMPTS; attempt++)); do
        start_node "$name" "$@"
        pgid="$(cat "$PGID_DIR/$name.pgid")"
        while ((SECONDS < UP_DEADLINE)); do
            node_ready "$name" && return 0
            group_alive "$pgid" || break
            sleep 1
        done
        ((SECONDS < UP_DEADLINE)) || return 1
        log "$name did not come up (attempt $attempt of $START_ATTEMPTS); log: $LOG_DIR/$name.log"
        stop_groups "$pgid"
    done
    return 1
}

# True once the job API answers an authenticated request.
job_api_answers() {
    "$PYTHON" - "$DASHBOARD_URL" "$TOKEN_FILE" <<'EOF' 2>/dev/null
import sys, urllib.request
url, token_file = sys.argv[1], sys.argv[2]
token = open(token_file).read().strip()
req = urllib.request.Request(url + "/api/jobs/", headers={"Authorization": "Bearer " + token})
urllib.request.urlopen(req, timeout=5).read()
EOF
}

cmd_up() {
    [[ -z "$(live_pgids)" ]] || die "a cluster is already running from $CLUSTER_DIR; run '$0 down' first"
    local p
    for p in "$HEAD_PORT" "$DASHBOARD_PORT"; do
        if port_in_use "$p"; then
            die "port $p is in use; choose others with ZR_HEAD_PORT / ZR_DASHBOARD_PORT"
        fi
    done
    # Longest socket path Ray creates: <temp>/session_YYYY-MM-DD_HH-MM-SS_ffffff_PID/sockets/plasma_store
    local longest
    longest="$(node_temp_dir "worker$NUM_WORKER_NODES")/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store"
    ((${#longest} <= 107)) || die "ZR_CLUSTER_DIR=$CLUSTER_DIR is too long for Ray's unix sockets; use a shorter path"
    mkdir -p "$CLUSTER_DIR" "$PGID_DIR" "$LOG_DIR"
    rm -f "$PGID_DIR"/*.pgid

    "$PYTHON" -c 'import secrets; print(secrets.token_hex(8))' >"$ID_FILE"
    if [[ ! -s "$TOKEN_FILE" ]]; then
        (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' >"$TOKEN_FILE")
    fi
    auth_env

    UP_DEADLINE=$((SECONDS + UP_TIMEOUT))
    # One node at a time: starting them together makes their raylets miss Ray's 30 s
    # registration deadline on a loaded 2-core machine.
    local name
    for name in $(node_names); do
        local args=(--address "$GCS_ADDRESS")
        if [[ "$name" == head ]]; then
            args=(--head --port "$HEAD_PORT"
                --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT"
                --ray-client-server-port "$(free_port)")
        fi
        if ! start_node_and_wait "$name" "${args[@]}"; then
            tail -n 30 "$LOG_DIR/$name.log" >&2 || true
            cmd_down >&2 || true
            die "$name did not come up within ${UP_TIMEOUT}s (logs: $LOG_DIR)"
        fi
    done
    local want=$((NUM_WORKER_NODES + 1))
    cat <<EOF
local-cluster: $want nodes alive
  GCS address:   $GCS_ADDRESS
  dashboard:     $DASHBOARD_URL
  state dir:     $CLUSTER_DIR  (token: $TOKEN_FILE)

Clients need the cluster's token (token authentication is on):
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
  (or: eval "\$(bash $0 env)")

Submit a job from the repository root:
  RAY_ADDRESS=$DASHBOARD_URL ray job submit --working-dir . \\
      --runtime-env-json '{"excludes": [".git"]}' \\
      -- python examples/train_gpt.py --num-workers 2 --placement-strategy SPREAD

Or connect a driver:   RAY_ADDRESS=$GCS_ADDRESS python your_script.py
Stop:                  bash $0 down
EOF
}

cmd_down() {
    local pgids pgid
    pgids="$(live_pgids)"
    if [[ -z "$pgids" && -z "$(marked_pids)" ]]; then
        log "nothing running from $CLUSTER_DIR"
        rm -f "$PGID_DIR"/*.pgid 2>/dev/null || true
        return 0
    fi
    # Workers first, head last, so the workers do not spend the wait retrying the GCS.
    for pgid in $(echo "$pgids" | tac); do
        kill -TERM -- "-$pgid" 2>/dev/null || true
    done
    local pid
    if wait_gone "$DOWN_TIMEOUT" groups; then
        # What Ray started outside the node groups: workers exit with their raylet, a
        # job driver keeps retrying the GCS for a minute. They are ours: SIGTERM them.
        for pid in $(marked_pids); do kill -TERM "$pid" 2>/dev/null || true; done
        wait_gone 10 all || true
    fi
    if [[ -n "$(live_pgids)" || -n "$(marked_pids)" ]]; then
        log "still running after SIGTERM; sending SIGKILL"
        for pgid in $(live_pgids); do kill -KILL -- "-$pgid" 2>/dev/null || true; done
        for pid in $(marked_pids); do kill -KILL "$pid" 2>/dev/null || true; done
        wait_gone 10 all || die "processes left: groups [$(live_pgids | xargs)] pids [$(marked_pids | xargs)]"
    fi
    rm -f "$PGID_DIR"/*.pgid
    log "stopped (state kept in $CLUSTER_DIR)"
}

# add-node NAME: start one more worker node (NAME is workerN) and wait until it is alive.
cmd_add_node() {
    local name="${1:-}"
    [[ "$name" =~ ^worker[0-9]+$ ]] || die "add-node needs a name workerN, got '$name'"
    [[ -n "$(live_pgids)" ]] || die "no cluster is running from $CLUSTER_DIR; run '$0 up' first"
    if [[ -e "$PGID_DIR/$name.pgid" ]] && group_alive "$(cat "$PGID_DIR/$name.pgid")"; then
        die "$name is running already (pgid $(cat "$PGID_DIR/$name.pgid"))"
    fi
    auth_env
    UP_DEADLINE=$((SECONDS + UP_TIMEOUT))
    if ! start_node_and_wait "$name" --address "$GCS_ADDRESS"; then
        tail -n 30 "$LOG_DIR/$name.log" >&2 || true
        [[ -e "$PGID_DIR/$name.pgid" ]] && stop_groups "$(cat "$PGID_DIR/$name.pgid")"
        rm -f "$PGID_DIR/$name.pgid"
        die "$name did not come up within ${UP_TIMEOUT}s (log: $LOG_DIR/$name.log)"
    fi
}

# kill-node NAME: the node is lost, as when its machine dies: SIGKILL to its `ray start`
# process group, nothing else (the actors it ran die with their raylet; the GCS notices).
cmd_kill_node() {
    local name="${1:-}" pgid
    [[ -e "$PGID_DIR/$name.pgid" ]] || die "no node '$name' in $PGID_DIR"
    [[ "$name" != head ]] || die "kill-node ends worker nodes only; 'down' stops the head"
    pgid="$(cat "$PGID_DIR/$name.pgid")"
    kill -KILL -- "-$pgid" 2>/dev/null || true
    local deadline=$((SECONDS + 10))
    while group_alive "$pgid" && ((SECONDS < deadline)); do sleep 0.2; done
    group_alive "$pgid" && die "$name (pgid $pgid) is still alive after SIGKILL"
    rm -f "$PGID_DIR/$name.pgid"
    log "killed $name (pgid $pgid)"
}

cmd_status() {
    local pgids
    pgids="$(live_pgids)"
    if [[ -z "$pgids" ]]; then
        log "not running (state dir $CLUSTER_DIR)"
        return 1
    fi
    local name
    for name in $(node_names); do
        [[ -e "$PGID_DIR/$name.pgid" ]] && echo "$name: pgid $(cat "$PGID_DIR/$name.pgid")"
    done
    echo "dashboard: $DASHBOARD_URL"
    auth_env
    "$PYTHON" - "$GCS_ADDRESS" <<'EOF'
import sys
from ray._raylet import GcsClient
nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10)
print(f"{'node id':<58} {'ip':<15} {'state':<6} resources")
for node_id, n in sorted(nodes.items(), key=lambda kv: not kv[1].is_head_node):
    state = "ALIVE" if n.state == 0 else "DEAD"
    head = " (head)" if n.is_head_node else ""
    res = ", ".join(
        f"{k}={v / 2**30:.1f}GiB" if "memory" in k else f"{k}={v:g}"
        for k, v in sorted(n.resources_total.items())
        if not k.startswith("node:")
    )
    print(f"{node_id.hex():<58} {n.node_manager_address:<15} {state:<6} {res}{head}")
EOF
}

# RAY_ADDRESS here is the job API, for `ray job ...`; a driver calling ray.init() wants
# the GCS address instead (RAY_ADDRESS=<ip>:$HEAD_PORT).
cmd_env() {
    cat <<EOF
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
unset RAY_AUTH_TOKEN
export RAY_ADDRESS=$DASHBOARD_URL
EOF
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    add-node) cmd_add_node "${2:-}" ;;
    kill-node) cmd_kill_node "${2:-}" ;;
    *)
        echo "usage: $0 up|down|status|env|add-node workerN|kill-node workerN" >&2
        exit 2
        ;;
esac
