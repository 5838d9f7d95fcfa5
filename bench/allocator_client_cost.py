#!/usr/bin/env python3
"""What reporting allocator statistics costs a training job.

The reporter thread of clients/python does one tick per second: read the
stats, encode one JSON line, one non-blocking send. This measures a tick,
back to back, in three situations a job meets:

  * a live headroom-agent (release build, --source sim) reading the socket;
  * an agent that accepts but never reads (a wedged agent): sends fail fast
    and reports are dropped;
  * no agent at all: the socket is missing, and reconnects are rate-limited.

The stats provider returns 8 devices of fixed numbers, so the figures are
the package's own cost; torch.cuda.memory_stats() itself is PyTorch's and
not included. Prints the median and p99 wall time and the CPU time per tick,
and the share of one core at the default one tick per second.

Usage: python3 bench/allocator_client_cost.py [--ticks 20000]
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))

import headroom_client  # noqa: E402

GIB = 1 << 30


def provider():
    return [
        {"index": i, "uuid": f"GPU-{i:08x}-1111-2222-3333-444455556666",
         "allocated_bytes": 30 * GIB + i, "reserved_bytes": 50 * GIB,
         "active_bytes": 31 * GIB, "inactive_split_bytes": 3 * GIB,
         "peak_allocated_bytes": 40 * GIB, "alloc_retries": 7, "ooms": 0}
        for i in range(8)
    ]


def measure(socket_path, ticks):
    reporter = headroom_client.Reporter(socket_path, stats_provider=provider,
                                        reconnect_interval_s=5.0)
    wall, cpu = [], []
    for _ in range(ticks):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        reporter.tick()
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - w0)
    counters = (reporter.sent, reporter.dropped, reporter.errors)
    reporter.stop()
    return wall, cpu, counters


def p99(values):
    return sorted(values)[int(len(values) * 0.99)]


def report(name, wall, cpu, counters):
    cpu_median = statistics.median(cpu)
    print(f"{name:<28} wall median {statistics.median(wall) / 1000:7.1f} us  p99 {p99(wall) / 1000:7.1f} us  "
          f"CPU median {cpu_median / 1000:6.1f} us  -> {cpu_median / 1e9 * 100:.4f} % of a core at 1 tick/s  "
          f"(sent {counters[0]}, dropped {counters[1]}, errors {counters[2]})")


def agent_binary():
    binary = ROOT / "target" / "release" / "headroom-agent"
    subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "headroom-agent"],
                   cwd=ROOT, check=True)
    return binary


def wait_for(path):
    for _ in range(200):
        if os.path.exists(path):
            return
        time.sleep(0.05)
    raise SystemExit(f"{path} never appeared")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=20000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="headroom-alloc-bench-"))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.ticks} ticks per case, 8 devices per report")

    live = work / "live.sock"
    agent = subprocess.Popen(
        [str(agent_binary()), "--source", "sim", "--sim-node", "gpu-node-01",
         "--collector-url", "http://127.0.0.1:1", "--metrics-listen", "127.0.0.1:0",
         "--allocator-socket", str(live)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(live)
        report("live agent", *measure(str(live), args.ticks))
    finally:
        agent.terminate()
        agent.wait()

    stalled = work / "stalled.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(stalled))
    server.listen(1)
    report("agent that never reads", *measure(str(stalled), args.ticks))
    server.close()

    report("no agent", *measure(str(work / "missing.sock"), args.ticks))


if __name__ == "__main__":
    main()
