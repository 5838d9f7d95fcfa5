#!/usr/bin/env python3
"""The dashboard with a large fleet: load time and live-update cost in Chromium.

Builds the release collector, writes a scenario of N nodes x 8 GPUs (one
process each), runs `headroom-collector demo` on it (N simulated agents
streaming over gRPC into SQLite), waits until every GPU has a sample, then
runs tests/browser/fleet_load.mjs in Debian's Chromium once per view (the
grid of cells, the tiles), side by side on the same fleet: fresh loads of the
fleet view to every device filled, the bytes transferred, and 20 s of live
updates (sample-to-screen latency, cost of each render).

Needs chromium and `npm ci --prefix tests/browser`.
Usage: python3 bench/dashboard_load.py [--nodes 125] [--views grid,tiles] [--loads 5]
       [--collector LABEL=PATH ...]   # other builds, each on a fresh demo, in the order given
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def scenario(nodes):
    out = []
    for n in range(nodes):
        out.append(f'[[node]]\nname = "bench-{n:03d}"\ndriver_version = "550.54.15"\n')
        for g in range(8):
            out.append('[[node.gpu]]\nmodel = "NVIDIA H100 80GB HBM3"\nmemory_total = "80GiB"\nreserved = "512MiB"\n')
            out.append(f'[[node.gpu.process]]\npid = {1000 + g}\nname = "python train.py"\n'
                       f'memory = {{ shape = "sawtooth", low = "{10 + g}GiB", high = "{40 + 4 * g}GiB", period_s = 120 }}\n')
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=125)
    parser.add_argument("--views", default="grid,tiles", help="comma-separated: grid, tiles")
    parser.add_argument("--loads", type=int, default=5, help="fresh loads per view")
    parser.add_argument("--collector", action="append", default=[], metavar="LABEL=PATH",
                        help="a collector binary to measure instead of this tree's (repeat to compare builds side by side)")
    args = parser.parse_args()
    builds = []
    for spec in args.collector:
        label, _, path = spec.partition("=")
        if not path:
            sys.exit(f"--collector {spec!r}: give LABEL=PATH")
        builds.append((label, Path(path)))
    if not builds:
        subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "headroom-collector"], cwd=ROOT, check=True)
        builds = [("this tree", ROOT / "target/release/headroom-collector")]
    for label, binary in builds:
        print(f"# {label}: {binary}", flush=True)
        measure(args, binary)


def measure(args, binary):
    work = Path(tempfile.mkdtemp(prefix="headroom-dash-bench-"))
    (work / "fleet.toml").write_text(scenario(args.nodes))
    demo = subprocess.Popen(
        [str(binary), "demo", "--scenario", str(work / "fleet.toml"),
         "--http-listen", "127.0.0.1:0", "--data-dir", str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={"RUST_LOG": "warn", "PATH": "/usr/bin:/bin"})
    try:
        url = None
        for line in demo.stdout:
            if line.strip().startswith("dashboard: "):
                url = line.strip().split(" ", 1)[1].rstrip("/")
                break
        if url is None:
            sys.exit("the demo printed no dashboard URL")
        # Keep draining the demo's output so it never blocks or dies on a closed pipe.
        import threading
        threading.Thread(target=lambda: [None for _ in demo.stdout], daemon=True).start()
        want = args.nodes * 8
        for _ in range(120):
            gpus = json.load(urllib.request.urlopen(f"{url}/api/v1/gpus"))
            if sum(1 for g in gpus if g["latest"]) >= want:
                break
            time.sleep(1)
        else:
            sys.exit("not every GPU reported within 2 minutes")
        for view in args.views.split(","):
            result = subprocess.run(["node", str(ROOT / "tests/browser/fleet_load.mjs"), url, str(want), view, str(args.loads)],
                                    capture_output=True, text=True, check=True)
            print(result.stdout.strip(), flush=True)
    finally:
        demo.terminate()
        demo.wait()


if __name__ == "__main__":
    main()
