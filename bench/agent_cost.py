#!/usr/bin/env python3
"""What the agent costs a GPU host, side by side with gpustat.

Runs, in one go and on the same fake libnvidia-ml (8 GPUs x 50 processes,
fake-nvml/scenarios/bench-8x50.toml):
  * headroom-agent --source nvml at 10 Hz, shipping to a local collector
    (SQLite), attributing every process from a procfs tree;
  * gpustat (PyPI) refreshing at the same 10 Hz (`gpustat -i 0.1`);
and reports each one's CPU as % of one core and peak RSS (whole process,
from /proc), then the agent's cost per poll cycle (examples/poll_cost.rs).

    python3 bench/agent_cost.py [--seconds 60] [--agent LABEL=DIR ...]

`--agent LABEL=DIR` runs DIR/headroom-agent (an earlier build) beside this
build's, in the same run, on the same fake library, procfs tree and
collector, so that the two are compared under the same load.

Needs cargo and pip (gpustat goes into a venv under target/bench-venv).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "target" / "release"
SCENARIO = ROOT / "fake-nvml" / "scenarios" / "bench-8x50.toml"
TICKS = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def thread_cpu(pid):
    """CPU seconds per thread name (names are cut to 15 bytes by the kernel)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0) + (int(fields[11]) + int(fields[12])) / TICKS
    return out


def peak_rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build():
    subprocess.run(
        ["cargo", "build", "--release", "--quiet", "-p", "headroom-agent",
         "-p", "headroom-collector", "-p", "headroom-fake-nvml"],
        cwd=ROOT, check=True)
    subprocess.run(
        ["cargo", "build", "--release", "--quiet", "-p", "headroom-agent",
         "--example", "poll_cost"],
        cwd=ROOT, check=True)


def gpustat_venv():
    venv = ROOT / "target" / "bench-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "gpustat"], check=True)
    return venv


def gpu_pids(python, env):
    """The scenario's pids, as NVML lists them (through pynvml)."""
    script = (
        "import json, pynvml\n"
        "pynvml.nvmlInit()\n"
        "pids = []\n"
        "for i in range(pynvml.nvmlDeviceGetCount()):\n"
        "    h = pynvml.nvmlDeviceGetHandleByIndex(i)\n"
        "    pids += [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]\n"
        "print(json.dumps(pids))\n")
    out = subprocess.run([str(python), "-c", script], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def write_procfs(root, pids):
    """A procfs tree for `pids`: a mix of Slurm, Kubernetes and Docker owners."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu  1 2 3 4\nbtime 1700000000\n")
    for n, pid in enumerate(pids):
        d = root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        uid = 1000 + n % 7
        (d / "stat").write_text(
            f"{pid} (python) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 1 1 0 0 20 0 8 0 "
            f"{pid * 10} 1000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n")
        (d / "status").write_text(
            f"Name:\tpython\nTgid:\t{pid}\nNSpid:\t{pid}\nPid:\t{pid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (d / "cmdline").write_bytes(f"python\0train.py\0--rank\0{n}\0".encode())
        cid = f"{pid:064x}"
        if n % 3 == 0:
            cgroup = f"0::/system.slice/slurmstepd.scope/job_{4000 + n // 8}/step_0/user/task_0\n"
        elif n % 3 == 1:
            pod = f"{n:08x}-1111-2222-3333-444455556666"
            cgroup = (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                      f"{pod.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n")
        else:
            cgroup = f"0::/system.slice/docker-{cid}.scope\n"
        (d / "cgroup").write_text(cgroup)


def wait_http(url, seconds=20, log=None):
    import urllib.request
    end = time.time() + seconds
    while time.time() < end:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.2)
    said = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
    raise SystemExit(f"{url} did not answer\n{said}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--agent", action="append", default=[],
                        help="LABEL=DIR: DIR/headroom-agent runs beside this build's")
    args = parser.parse_args()
    others = []
    for spec in args.agent:
        label, sep, directory = spec.partition("=")
        binary = Path(directory) / "headroom-agent"
        if not sep or not label or not binary.is_file():
            parser.error(f"--agent {spec!r}: want LABEL=DIR with DIR/headroom-agent")
        others.append((label, binary))

    build()
    venv = gpustat_venv()
    work = Path(tempfile.mkdtemp(prefix="headroom-bench-"))
    procs = []
    try:
        libdir = work / "lib"
        libdir.mkdir()
        (libdir / "libnvidia-ml.so.1").symlink_to(RELEASE / "libnvidia_ml.so")
        env = dict(os.environ, HEADROOM_FAKE_NVML_SCENARIO=str(SCENARIO),
                   LD_LIBRARY_PATH=str(libdir), RUST_LOG="warn")
        pids = gpu_pids(venv / "bin" / "python", env)
        procfs = work / "proc"
        write_procfs(procfs, pids)

        grpc, http, metrics = free_port(), free_port(), free_port()
        collector = subprocess.Popen(
            [str(RELEASE / "headroom-collector"), "serve",
             "--grpc-listen", f"127.0.0.1:{grpc}", "--http-listen", f"127.0.0.1:{http}"],
            env=dict(env, HEADROOM_DATABASE_URL=f"sqlite://{work}/h.db"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(collector)
        wait_http(f"http://127.0.0.1:{http}/healthz")

        def start_agent(binary, node, metrics_port, socket_name):
            p = subprocess.Popen(
                [str(binary), "--source", "nvml", "--node-name", node,
                 "--nvml-library", str(RELEASE / "libnvidia_ml.so"), "--procfs-root", str(procfs),
                 "--collector-url", f"http://127.0.0.1:{grpc}",
                 "--metrics-listen", f"127.0.0.1:{metrics_port}",
                 "--poll-interval-ms", "100", "--sample-interval-ms", "1000",
                 "--allocator-socket", str(work / socket_name),
                 "--spool-dir", str(work / f"spool-{node}")],
                env=env, stdout=subprocess.DEVNULL,
                stderr=open(work / f"{node}.log", "wb"))
            procs.append(p)
            return p

        agent = start_agent(RELEASE / "headroom-agent", "bench-node", metrics, "allocator.sock")
        other_agents = {}
        for n, (label, binary) in enumerate(others):
            port = free_port()
            other_agents[label] = (start_agent(binary, f"bench-node-{n + 1}", port,
                                               f"allocator-{n + 1}.sock"), port)
        gpustat = subprocess.Popen(
            [str(venv / "bin" / "gpustat"), "--interval", "0.1", "--no-processes"],
            env=dict(env, TERM="dumb"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gpustat)
        gpustat_full = subprocess.Popen(
            [str(venv / "bin" / "gpustat"), "--interval", "0.1", "--show-pid", "--show-cmd"],
            env=dict(env, TERM="dumb"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gpustat_full)
        wait_http(f"http://127.0.0.1:{metrics}/healthz", log=work / "bench-node.log")
        for n, (_, port) in enumerate(other_agents.values()):
            wait_http(f"http://127.0.0.1:{port}/healthz", log=work / f"bench-node-{n + 1}.log")

        time.sleep(5)  # warm-up: layouts, attribution, first shipments
        agents = {"headroom-agent": agent}
        agents.update({f"headroom-agent ({label})": p for label, (p, _) in other_agents.items()})
        watched = dict(agents)
        watched.update({"gpustat -i 0.1 (no processes)": gpustat,
                        "gpustat -i 0.1 --show-pid --show-cmd": gpustat_full})
        for name, p in watched.items():
            if p.poll() is not None:
                raise SystemExit(f"{name} exited early with {p.returncode}")
        before = {name: cpu_seconds(p.pid) for name, p in watched.items()}
        threads_before = {name: thread_cpu(p.pid) for name, p in agents.items()}
        started = time.monotonic()
        time.sleep(args.seconds)
        elapsed = time.monotonic() - started
        after = {name: cpu_seconds(p.pid) for name, p in watched.items()}
        threads_after = {name: thread_cpu(p.pid) for name, p in agents.items()}
        rss = {name: peak_rss_mib(p.pid) for name, p in watched.items()}

        import urllib.request
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics").read().decode()
        polls = next((l.split()[-1] for l in exposition.splitlines()
                      if l.startswith("headroom_agent_polls_total")), "?")

        print(f"machine: {os.cpu_count()} cores; window {elapsed:.0f} s at 10 Hz; "
              f"{len(pids)} GPU processes on 8 GPUs; agent polls so far: {polls}")
        print(f"{'process':40} {'CPU % of one core':>18} {'peak RSS MiB':>13}")
        cpu = {}
        for name in watched:
            cpu[name] = 100 * (after[name] - before[name]) / elapsed
            print(f"{name:40} {cpu[name]:18.2f} {rss[name]:13.1f}")
        for agent_name in agents:
            print(f"{agent_name} CPU by thread (% of one core):")
            before_threads = threads_before[agent_name]
            for name, seconds in sorted(threads_after[agent_name].items(), key=lambda kv: -kv[1]):
                share = 100 * (seconds - before_threads.get(name, 0)) / elapsed
                print(f"  {name:24} {share:6.2f}")
        for name in list(watched)[1:]:
            if cpu["headroom-agent"] > 0:
                print(f"CPU ratio {name} / headroom-agent: {cpu[name] / cpu['headroom-agent']:.2f}x")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()

    print("poll cycle (examples/poll_cost.rs, back to back, 2000 polls):")
    subprocess.run([str(RELEASE / "examples" / "poll_cost"), str(RELEASE / "libnvidia_ml.so"),
                    str(procfs), "2000"], env=env, check=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
