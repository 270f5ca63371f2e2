# Sourced by scripts that measure this project and Mooncake side by side: start a master and one
# owner of either store on loopback, and stop everything started, by pid. Expects `root` (the
# checkout) and sets `out` (a temp dir for logs) and `pids`.
#   start_ours PORT SEGMENT_MIB    -> OURS_MASTER_PID; master at 127.0.0.1:PORT, metrics PORT+1
#   start_peer PORT SEGMENT_MIB    -> PEER_MASTER_PID PEER_VENV PEER_RPC PEER_METADATA (ports PORT..PORT+3)
#   stop_all                         stops what was started, newest first
# MASTER_ARGS (words): extra flags for either master, e.g. "--eviction_high_watermark_ratio=0.95"
# (a spelling both masters take).

out=$(mktemp -d)
pids=()
cleanup() {
  stop_all
  rm -rf "$out"
}
trap cleanup EXIT

wait_for() { # wait_for WHAT TRIES COMMAND...: up to TRIES tenths of a second
  local what=$1 tries=$2
  shift 2
  for _ in $(seq 1 "$tries"); do "$@" && return 0; sleep 0.1; done
  echo "$(basename "$0"): $what did not come up; logs in $out" >&2
  # The logs stay; what was started does not.
  stop_all
  trap - EXIT
  exit 3
}

stop_all() { # TERM, then KILL after 5 s, newest first
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    local pid=${pids[$i]}
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    wait "$pid" 2>/dev/null || true
  done
  pids=()
}

start_ours() {
  local port=$1 segment_mib=$2
  # shellcheck disable=SC2086
  target/release/mooncake_master --rpc_address 127.0.0.1 --rpc_port "$port" --metrics_port $((port + 1)) \
    ${MASTER_ARGS:-} > "$out/master.log" 2>&1 &
  OURS_MASTER_PID=$!
  pids+=("$OURS_MASTER_PID")
  wait_for "our master" 100 grep -q '^mooncake_master ready' "$out/master.log"
  rm -f "$out/owner.ready"
  target/release/mooncake_ownerd --master "127.0.0.1:$port" --host 127.0.0.1 --port 0 \
    --segment-size "${segment_mib}MiB" --no-mlock --ready-file "$out/owner.ready" > "$out/owner.log" 2>&1 &
  pids+=($!)
  wait_for "our owner" 300 test -s "$out/owner.ready"
}

start_peer() {
  local port=$1 segment_mib=$2 peer_dir mcdir
  peer_dir=$(cd "${PEER:-$root/../shared/peer}" && pwd)
  PEER_VENV=$("$peer_dir/install_mooncake.sh")
  mcdir=$("$PEER_VENV/bin/python" -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')
  local rpc=$port http=$((port + 1)) metrics=$((port + 2)) owner=$((port + 3))
  export MC_TCP_BIND_ADDRESS=127.0.0.1
  "$mcdir/mooncake_master" --rpc_port="$rpc" --rpc_address=127.0.0.1 \
    --enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1 \
    --http_metadata_server_port="$http" --metrics_host=127.0.0.1 --metrics_port="$metrics" \
    --logtostderr ${MASTER_ARGS:-} > "$out/peer-master.log" 2>&1 &
  PEER_MASTER_PID=$!
  pids+=("$PEER_MASTER_PID")
  wait_for "Mooncake's master" 300 bash -c "ss -Hltn 'sport = :$rpc' | grep -q . && ss -Hltn 'sport = :$http' | grep -q ."
  "$mcdir/mooncake_client" --master_server_address="127.0.0.1:$rpc" \
    --metadata_server="http://127.0.0.1:$http/metadata" --global_segment_size="$((segment_mib << 20))" \
    --protocol=tcp --host=127.0.0.1 --port="$owner" --logtostderr > "$out/peer-owner.log" 2>&1 &
  pids+=($!)
  wait_for "Mooncake's owner" 600 bash -c "curl -s -m 2 http://127.0.0.1:$metrics/metrics | awk '/^master_total_capacity_bytes/ && \$2 > 0 {up = 1} END {exit !up}'"
  PEER_RPC="127.0.0.1:$rpc"
  PEER_METADATA="http://127.0.0.1:$http/metadata"
}
