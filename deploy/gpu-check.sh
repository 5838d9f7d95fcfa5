#!/usr/bin/env bash
# Checks the agent's NVML path on a real NVIDIA host: builds the agent and the
# collector, runs both for 20 s (collector on SQLite in a temp dir, loopback
# only), and prints what the agent saw: inventory, memory per GPU and MIG
# instance, processes with their owners, and the agent's own metrics.
#
#   deploy/gpu-check.sh [seconds]      # default 20
#
# Needs: cargo, the NVIDIA driver (libnvidia-ml.so.1), curl. Exits non-zero
# when the agent cannot load NVML or no GPU sample reaches the collector.
set -euo pipefail

seconds="${1:-20}"
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'kill ${agent_pid:-} ${collector_pid:-} 2>/dev/null || true; rm -rf "$work"' EXIT

echo "== driver"
nvidia-smi --query-gpu=index,name,memory.total,memory.used,mig.mode.current --format=csv 2>/dev/null \
  || echo "(nvidia-smi not found; relying on libnvidia-ml alone)"

echo "== building (release)"
cargo build --release --quiet --manifest-path "$root/Cargo.toml" -p headroom-agent -p headroom-collector
bin="$root/target/release"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
grpc_port="$(free_port)"; http_port="$(free_port)"; metrics_port="$(free_port)"

HEADROOM_DATABASE_URL="sqlite://$work/headroom.db" "$bin/headroom-collector" serve \
  --grpc-listen "127.0.0.1:$grpc_port" --http-listen "127.0.0.1:$http_port" \
  >"$work/collector.log" 2>&1 &
collector_pid=$!
for _ in $(seq 50); do curl -fsS "http://127.0.0.1:$http_port/healthz" >/dev/null 2>&1 && break; sleep 0.2; done

echo "== running the agent on real NVML for ${seconds}s"
"$bin/headroom-agent" --source nvml --collector-url "http://127.0.0.1:$grpc_port" \
  --metrics-listen "127.0.0.1:$metrics_port" --allocator-socket "$work/allocator.sock" \
  >"$work/agent.log" 2>&1 &
agent_pid=$!
sleep "$seconds"
if ! kill -0 "$agent_pid" 2>/dev/null; then
  echo "!! the agent exited:"; cat "$work/agent.log"; exit 1
fi

echo "== agent log"
cat "$work/agent.log"
echo "== fleet (collector status)"
"$bin/headroom-collector" status --url "http://127.0.0.1:$http_port"
echo "== GPUs and MIG instances (API)"
curl -fsS "http://127.0.0.1:$http_port/api/v1/gpus" | python3 -m json.tool
echo "== processes with owners (API)"
curl -fsS "http://127.0.0.1:$http_port/api/v1/processes" | python3 -m json.tool
echo "== agent metrics (GPU, events, poll cost)"
curl -fsS "http://127.0.0.1:$metrics_port/metrics" \
  | grep -E '^headroom_(gpu_memory_used_bytes|gpu_pcie|gpu_stalled|agent_events_total|agent_poll_duration_seconds|agent_polls_total)' || true
echo "== agent CPU and memory"
awk '{print "cpu seconds (user+system): " ($14+$15)/100}' "/proc/$agent_pid/stat"
grep -E '^(VmHWM|VmRSS)' "/proc/$agent_pid/status"

samples="$(curl -fsS "http://127.0.0.1:$http_port/api/v1/gpus" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(len(d) if isinstance(d,list) else len(d.get("gpus",[])))')"
if [ "$samples" -eq 0 ]; then
  echo "!! no GPU reached the collector"; cat "$work/collector.log"; exit 1
fi
echo "OK: $samples GPUs/instances reported"
