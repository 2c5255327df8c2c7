#!/usr/bin/env bash
# A three-node Cairn cluster on this machine, on loopback:
#   - three nats-servers with JetStream, routed into one cluster (clients on 4222, 4223, 4224),
#   - moto's S3 server as the shared snapshot repository (5000),
#   - three cairn nodes n1, n2, n3 (gRPC on 5221, 5222, 5223; Redis protocol on 6381, 6382,
#     6383; metrics on 5231, 5232, 5233).
# Everything lives under one folder (default ./cairn-cluster): each process's data and log, and
# the pid files `stop` uses.
#
#   scripts/cluster.sh start [DIR]    installs what is missing, builds, starts, prints addresses
#   scripts/cluster.sh stop [DIR]     stops the nodes, then NATS and moto (data is kept)
#   scripts/cluster.sh status [DIR]   what runs
#   scripts/cluster.sh kill NODE [DIR]     SIGKILLs node NODE (n1, n2 or n3), to watch a failover
#   scripts/cluster.sh restart NODE [DIR]  starts NODE again (after a kill or a stop of it)
#
# A second `start` on the same folder starts the same cluster again, with its data.
set -euo pipefail
cd "$(dirname "$0")/.."
command="${1:-}"
case "$command" in
  kill|restart) node="${2:-}"; dir_arg="${3:-}" ;;
  *) node=""; dir_arg="${2:-}" ;;
esac
dir="$(realpath -m "${dir_arg:-./cairn-cluster}")"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cairn-target}"
bin="$CARGO_TARGET_DIR/release"

nats_ports=(4222 4223 4224)
route_ports=(6222 6223 6224)
grpc_ports=(5221 5222 5223)
metrics_ports=(5231 5232 5233)
resp_ports=(6381 6382 6383)
moto_port=5000

running() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Waits until something listens on 127.0.0.1:$1, or fails naming the log to read.
wait_for_port() {
  local port=$1 what=$2 log=$3
  for _ in $(seq 1 300); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "cluster.sh: $what did not listen on 127.0.0.1:$port within 30 s; see $log" >&2
  exit 1
}

start() {
  bash scripts/setup-debian.sh
  export PATH="$HOME/.cargo/bin:$PATH"
  cargo build --release --bins
  mkdir -p "$dir"
  # Only what is stopped is started, so only its ports must be free.
  local ports=()
  for i in 0 1 2; do
    running "$dir/nats$i.pid" || ports+=("${nats_ports[$i]}" "${route_ports[$i]}")
    running "$dir/n$((i + 1)).pid" || ports+=("${grpc_ports[$i]}" "${metrics_ports[$i]}" "${resp_ports[$i]}")
  done
  running "$dir/moto.pid" || ports+=($moto_port)
  for port in "${ports[@]}"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "cluster.sh: 127.0.0.1:$port is in use by another program; stop it first" >&2
      exit 1
    fi
  done

  local routes
  routes=$(printf 'nats://127.0.0.1:%s,' "${route_ports[@]}")
  routes=${routes%,}
  for i in 0 1 2; do
    local pid="$dir/nats$i.pid"
    running "$pid" && continue
    mkdir -p "$dir/nats$i"
    nats-server -js -a 127.0.0.1 -p "${nats_ports[$i]}" --server_name "nats$i" \
      --cluster_name cairn --cluster "nats://127.0.0.1:${route_ports[$i]}" --routes "$routes" \
      -sd "$dir/nats$i" >"$dir/nats$i.log" 2>&1 &
    echo $! >"$pid"
  done
  for i in 0 1 2; do wait_for_port "${nats_ports[$i]}" "nats-server $i" "$dir/nats$i.log"; done

  if ! running "$dir/moto.pid"; then
    python3 -m moto.server -H 127.0.0.1 -p $moto_port >"$dir/moto.log" 2>&1 &
    echo $! >"$dir/moto.pid"
  fi
  wait_for_port $moto_port "moto" "$dir/moto.log"
  export AWS_ACCESS_KEY_ID=cairn AWS_SECRET_ACCESS_KEY=cairn AWS_REGION=us-east-1
  # moto keeps its buckets in memory: create the repository's bucket on every start.
  python3 - <<EOF
import urllib.request
request = urllib.request.Request("http://127.0.0.1:$moto_port/cairn-snapshots", method="PUT")
try:
    urllib.request.urlopen(request)
except Exception as err:
    if "BucketAlreadyOwnedByYou" not in str(getattr(err, "read", lambda: b"")()):
        raise
EOF

  cat >"$dir/cairn.toml" <<EOF
cluster-name = "cairn"

[log]
provider = "nats"

[metadata]
provider = "nats"

[nats]
servers = ["nats://127.0.0.1:${nats_ports[0]}", "nats://127.0.0.1:${nats_ports[1]}", "nats://127.0.0.1:${nats_ports[2]}"]
replicas = 3

[cluster]
initial-nodes = 3
standbys = 1

[worker.snapshots]
destination = "s3://cairn-snapshots/cluster"
endpoint-url = "http://127.0.0.1:$moto_port"
allow-http = true
region = "us-east-1"
EOF
  for i in 0 1 2; do
    local name="n$((i + 1))" pid="$dir/n$((i + 1)).pid"
    running "$pid" && continue
    CAIRN_METRICS__BIND_ADDRESS="127.0.0.1:${metrics_ports[$i]}" \
    CAIRN_RESP__BIND_ADDRESS="127.0.0.1:${resp_ports[$i]}" \
      "$bin/cairn" --config "$dir/cairn.toml" --node-name "$name" --base-dir "$dir/$name" \
      --bind-address "127.0.0.1:${grpc_ports[$i]}" >"$dir/$name.log" 2>&1 &
    echo $! >"$pid"
  done
  for i in 0 1 2; do wait_for_port "${grpc_ports[$i]}" "cairn n$((i + 1))" "$dir/n$((i + 1)).log"; done
  echo "cluster.sh: waiting for the nodes to place and start the partitions..."
  for _ in $(seq 1 600); do
    if "$bin/cairnctl" --address "127.0.0.1:${grpc_ports[0]}" partitions list 2>/dev/null \
      | tail -n +2 | grep -v '^\s*$' | awk '{print $NF}' | grep -qvx active; then
      sleep 0.1
    else
      break
    fi
  done
  "$bin/cairnctl" --address "127.0.0.1:${grpc_ports[0]}" nodes list
  cat <<EOF

A three-node Cairn cluster runs, with its data under $dir:
  cairn nodes (gRPC):  127.0.0.1:${grpc_ports[0]}  127.0.0.1:${grpc_ports[1]}  127.0.0.1:${grpc_ports[2]}
  Redis protocol:      127.0.0.1:${resp_ports[0]}  127.0.0.1:${resp_ports[1]}  127.0.0.1:${resp_ports[2]}
  metrics:             http://127.0.0.1:${metrics_ports[0]}/metrics (and ${metrics_ports[1]}, ${metrics_ports[2]})
  NATS (JetStream):    nats://127.0.0.1:${nats_ports[0]} ${nats_ports[1]} ${nats_ports[2]}
  snapshots (moto S3): s3://cairn-snapshots/cluster at http://127.0.0.1:$moto_port
Any node answers any key, e.g.:
  $bin/cairnctl --address 127.0.0.1:${grpc_ports[1]} kv put greeting hello
  $bin/cairnctl --address 127.0.0.1:${grpc_ports[2]} partitions list
  redis-cli -p ${resp_ports[2]} GET greeting
Stop it with: scripts/cluster.sh stop $dir
EOF
}

stop() {
  # The nodes first (their last heartbeat says they stopped), then what they use.
  for name in n1 n2 n3 nats0 nats1 nats2 moto; do
    local pid="$dir/$name.pid"
    if running "$pid"; then
      kill -TERM "$(cat "$pid")"
      for _ in $(seq 1 300); do running "$pid" || break; sleep 0.1; done
      running "$pid" && kill -KILL "$(cat "$pid")"
    fi
    rm -f "$pid"
  done
  echo "cluster.sh: stopped; the data stays in $dir (moto's snapshots do not: it keeps them in memory)"
}

status() {
  for name in n1 n2 n3 nats0 nats1 nats2 moto; do
    if running "$dir/$name.pid"; then echo "$name: running (pid $(cat "$dir/$name.pid"))"; else echo "$name: stopped"; fi
  done
}

# The index (0, 1, 2) of node n1, n2 or n3.
node_index() {
  case "$1" in
    n1) echo 0 ;; n2) echo 1 ;; n3) echo 2 ;;
    *) echo "cluster.sh: no node $1; the nodes are n1, n2 and n3" >&2; exit 2 ;;
  esac
}

kill_node() {
  node_index "$node" >/dev/null
  local pid="$dir/$node.pid"
  if ! running "$pid"; then
    echo "cluster.sh: $node is not running" >&2
    exit 1
  fi
  kill -KILL "$(cat "$pid")"
  rm -f "$pid"
  echo "cluster.sh: $node killed (SIGKILL); after the node timeout (3 s) its partitions move to their followers:"
  echo "  $bin/cairnctl --address 127.0.0.1:${grpc_ports[0]} partitions list"
  echo "  $bin/cairnctl --address 127.0.0.1:${grpc_ports[0]} nodes list"
  echo "start it again with: scripts/cluster.sh restart $node $dir"
}

restart_node() {
  local i
  i=$(node_index "$node")
  local pid="$dir/$node.pid"
  if running "$pid"; then
    echo "cluster.sh: $node is running already" >&2
    exit 1
  fi
  if (exec 3<>"/dev/tcp/127.0.0.1/${grpc_ports[$i]}") 2>/dev/null; then
    echo "cluster.sh: 127.0.0.1:${grpc_ports[$i]} is in use by another program; stop it first" >&2
    exit 1
  fi
  export AWS_ACCESS_KEY_ID=cairn AWS_SECRET_ACCESS_KEY=cairn AWS_REGION=us-east-1
  CAIRN_METRICS__BIND_ADDRESS="127.0.0.1:${metrics_ports[$i]}" \
  CAIRN_RESP__BIND_ADDRESS="127.0.0.1:${resp_ports[$i]}" \
    "$bin/cairn" --config "$dir/cairn.toml" --node-name "$node" --base-dir "$dir/$node" \
    --bind-address "127.0.0.1:${grpc_ports[$i]}" >>"$dir/$node.log" 2>&1 &
  echo $! >"$pid"
  wait_for_port "${grpc_ports[$i]}" "cairn $node" "$dir/$node.log"
  echo "cluster.sh: $node runs again; it rejoins and follows what the placement gives it"
}

case "$command" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  kill) kill_node ;;
  restart) restart_node ;;
  *) echo "usage: scripts/cluster.sh start|stop|status [DIR], or kill|restart n1|n2|n3 [DIR]" >&2; exit 2 ;;
esac
