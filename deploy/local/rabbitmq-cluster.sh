#!/usr/bin/env bash
# A 3-node RabbitMQ cluster on this machine, for manual fail-over drills (issue #18).
#
# Nodes hpcrl-a@localhost, hpcrl-b@localhost and hpcrl-c@localhost listen for AMQP on
# 127.0.0.1:5681, 5682 and 5683 (Erlang distribution on 25681-25683), beside the system's
# rabbit@localhost on 5672, which this script never touches. Like tests/support/rabbit_node.py,
# each node runs the real scripts in /usr/lib/rabbitmq/bin as the current user with its own
# environment: its own HOME (the shared Erlang cookie), config, data and logs under
# $HPCRL_RABBIT_CLUSTER_DIR (default ~/.local/state/hpcrl/rabbitmq-cluster), an empty
# rabbitmq-env.conf instead of the system's, no plugins, and the system's epmd on 127.0.0.1.
# On first start, b and c join a's cluster (stop_app, join_cluster, start_app). Queues the
# services declare later are quorum queues with a member on each of the three nodes.
#
#   deploy/local/rabbitmq-cluster.sh start          start the nodes that are not running
#   deploy/local/rabbitmq-cluster.sh stop           stop all three (data kept)
#   deploy/local/rabbitmq-cluster.sh status         nodes, cluster members, quorum queues
#                                                   (exit status 1: no node runs)
#   deploy/local/rabbitmq-cluster.sh kill b         lose node b as a crash would (SIGKILL);
#                                                   `start` brings it back into the cluster
#   deploy/local/rabbitmq-cluster.sh ctl b ARGS...  rabbitmqctl against node b, e.g.
#                                                   `ctl b stop_app` / `ctl b start_app`
#   deploy/local/rabbitmq-cluster.sh queues b ARGS... rabbitmq-queues against node b, e.g.
#                                                   `queues a quorum_status generate-requests`
#
# Point the services at it (user guest works from 127.0.0.1 only; vhost /):
#
#   export HPCRL__BROKER__URL='amqp://guest:guest@127.0.0.1:5681/%2F'
#   export HPCRL__BROKER__FAILOVER_URLS='["amqp://127.0.0.1:5682/%2F", "amqp://127.0.0.1:5683/%2F"]'
#
# (or in a config file: [broker] url = "...", failover_urls = ["...", "..."]). Failover URLs
# take url's user, password (or broker.password_file), vhost and TLS settings; their scheme
# must be url's. A client connects to the first node that answers, in that order, and after
# losing its node reconnects to the next one that does.
#
# Wipe everything: stop, then rm -rf the directory above.
set -euo pipefail

RABBIT_BIN=${RABBIT_BIN:-/usr/lib/rabbitmq/bin}
DIR=${HPCRL_RABBIT_CLUSTER_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/hpcrl/rabbitmq-cluster}
NODES=(a b c)
declare -A PORT=([a]=5681 [b]=5682 [c]=5683)
START_TIMEOUT_S=${START_TIMEOUT_S:-120}

die() { echo "rabbitmq-cluster: $*" >&2; exit 1; }
node_name() { echo "hpcrl-$1@localhost"; }
base_of() { echo "$DIR/hpcrl-$1"; }

check_node() {
  [[ -n ${PORT[$1]:-} ]] || die "no node '$1': the nodes are ${NODES[*]}"
}

# Run a command in node $1's environment (that of tests/support/rabbit_node.py).
in_env() {
  local node=$1 base name
  shift
  base=$(base_of "$node")
  name=$(node_name "$node")
  env -u RABBITMQ_NODENAME -u RABBITMQ_NODE_PORT -u RABBITMQ_DIST_PORT \
    HOME="$base/home" \
    LANG="${LANG:-C.UTF-8}" \
    RABBITMQ_CONF_ENV_FILE="$base/rabbitmq-env.conf" \
    RABBITMQ_NODENAME="$name" \
    RABBITMQ_DIST_PORT="$((PORT[$node] + 20000))" \
    RABBITMQ_CONFIG_FILE="$base/rabbitmq.conf" \
    RABBITMQ_CONFIG_FILES="$base/conf.d" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$base/advanced.config" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$base/enabled_plugins" \
    RABBITMQ_MNESIA_BASE="$base/mnesia" \
    RABBITMQ_MNESIA_DIR="$base/mnesia/$name" \
    RABBITMQ_FEATURE_FLAGS_FILE="$base/mnesia/feature_flags" \
    RABBITMQ_PLUGINS_EXPAND_DIR="$base/plugins-expand" \
    RABBITMQ_LOG_BASE="$base/log" \
    RABBITMQ_LOGS="$base/log/$name.log" \
    RABBITMQ_PID_FILE="$base/rabbitmq.pid" \
    RABBITMQ_MOTD_FILE="$base/motd" \
    ERL_EPMD_ADDRESS=127.0.0.1 \
    ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}" \
    ERL_CRASH_DUMP="$base/erl_crash.dump" \
    "$@"
}

ctl() {  # ctl NODE [--tool TOOL] ARGS...
  local node=$1 tool=rabbitmqctl
  shift
  if [[ ${1:-} == --tool ]]; then tool=$2; shift 2; fi
  in_env "$node" "$RABBIT_BIN/$tool" -n "$(node_name "$node")" "$@"
}

write_files() {
  local node=$1 base
  base=$(base_of "$node")
  mkdir -p "$base"/{home,conf.d,mnesia,log,plugins-expand}
  if [[ ! -f $DIR/cookie ]]; then
    (umask 077; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F >"$DIR/cookie")
  fi
  local cookie=$base/home/.erlang.cookie
  [[ -f $cookie ]] && chmod 600 "$cookie"
  cp "$DIR/cookie" "$cookie"
  chmod 400 "$cookie"
  : >"$base/rabbitmq-env.conf"
  echo "[]." >"$base/enabled_plugins"
  echo "listeners.tcp.default = 127.0.0.1:${PORT[$node]}" >"$base/rabbitmq.conf"
}

running() { ctl "$1" -q status >/dev/null 2>&1; }

vm_pid() {  # the node's Erlang VM, from the pid file it writes while starting
  local file
  file="$(base_of "$1")/rabbitmq.pid"
  if [[ -s $file ]] && kill -0 "$(cat "$file")" 2>/dev/null; then cat "$file"; fi
}

group_of() {  # the process group of pid $1, never this script's own
  local group
  group=$(ps -o pgid= -p "$1" 2>/dev/null | tr -d ' ')
  if [[ -n $group && $group != "$(ps -o pgid= -p $$ | tr -d ' ')" ]]; then echo "$group"; fi
}

start_node() {
  local node=$1 base
  base=$(base_of "$node")
  write_files "$node"
  echo "starting $(node_name "$node") on 127.0.0.1:${PORT[$node]} (log: $base/log)"
  rm -f "$base/rabbitmq.pid"
  # Its own session and process group, so that `kill` reaches the VM and its helpers.
  in_env "$node" setsid "$RABBIT_BIN/rabbitmq-server" </dev/null >>"$base/console.out" 2>&1 &
}

joined() {  # is node $1 a member of a's cluster?
  ctl a -q cluster_status --formatter json 2>/dev/null | grep -q "\"$(node_name "$1")\""
}

cmd_start() {
  [[ -x $RABBIT_BIN/rabbitmq-server ]] || die "$RABBIT_BIN/rabbitmq-server is missing"
  mkdir -p "$DIR"
  local node out started=()
  for node in "${NODES[@]}"; do
    if running "$node"; then
      echo "$(node_name "$node") is running"
    else
      start_node "$node"
      started+=("$node")
    fi
  done
  local deadline=$((SECONDS + START_TIMEOUT_S))
  for node in "${started[@]}"; do
    # await_startup fails at once while the node is not registered with epmd yet: again.
    until ctl "$node" -q await_startup -t "$START_TIMEOUT_S" >/dev/null 2>&1; do
      if (( SECONDS >= deadline )); then
        die "$(node_name "$node") did not start within $START_TIMEOUT_S s; see" \
          "$(base_of "$node")/log"
      fi
      sleep 1
    done
  done
  for node in b c; do
    if ! joined "$node"; then
      echo "$(node_name "$node") joins $(node_name a)'s cluster"
      # (join_cluster logs harmless errors about tables of the other nodes: shown on failure)
      out=$(ctl "$node" -q stop_app 2>&1 && ctl "$node" -q join_cluster "$(node_name a)" 2>&1 &&
            ctl "$node" -q start_app 2>&1) || die "joining failed: $out"
    fi
  done
  cmd_status
}

cmd_stop() {
  local node pid group
  # c, b, then a (`start` starts all three together: they wait for one another).
  for node in c b a; do
    pid=$(vm_pid "$node")
    group=${pid:+$(group_of "$pid")}
    if running "$node"; then
      echo "stopping $(node_name "$node")"
      ctl "$node" -q stop >/dev/null || true
    fi
    if [[ -n $pid ]]; then
      for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      if [[ -n $group ]]; then kill -KILL -- "-$group" 2>/dev/null || true; fi
    fi
  done
}

cmd_kill() {
  local node=$1 pid group
  check_node "$node"
  pid=$(vm_pid "$node")
  [[ -n $pid ]] || die "$(node_name "$node") is not running"
  group=$(group_of "$pid")
  [[ -n $group ]] || die "no process group of its own for pid $pid"
  echo "killing $(node_name "$node") (SIGKILL to its process group $group)"
  kill -KILL -- "-$group"
}

cmd_status() {
  local node up=()
  for node in "${NODES[@]}"; do
    if running "$node"; then
      echo "$(node_name "$node"): running, AMQP on 127.0.0.1:${PORT[$node]}"
      up+=("$node")
    else
      echo "$(node_name "$node"): not running"
    fi
  done
  if (( ${#up[@]} == 0 )); then
    return 1
  fi
  echo "cluster as $(node_name "${up[0]}") sees it:"
  ctl "${up[0]}" -q cluster_status --formatter json |
    python3 -c 'import json, sys; s = json.load(sys.stdin)
print("  members:", ", ".join(sorted(s["disk_nodes"])))
print("  running:", ", ".join(sorted(s["running_nodes"])))'
  echo "quorum queues (name, members, messages):"
  ctl "${up[0]}" -q list_queues --no-table-headers name type members messages |
    awk -F'\t' '$2 == "quorum" {print "  " $1 "\t" $3 "\t" $4}'
}

case ${1:-} in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  kill) [[ $# -eq 2 ]] || die "usage: $0 kill a|b|c"; cmd_kill "$2" ;;
  ctl | queues)
    [[ $# -ge 3 ]] || die "usage: $0 $1 a|b|c ARGS..."
    check_node "$2"
    if [[ $1 == queues ]]; then ctl "$2" --tool rabbitmq-queues "${@:3}"; else ctl "$2" "${@:3}"; fi
    ;;
  *) die "usage: $0 start|stop|status|kill NODE|ctl NODE ARGS...|queues NODE ARGS..." ;;
esac
