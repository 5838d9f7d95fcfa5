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

Then what counting a model's memory costs (enable(model=, optimizer=)): one
read of the composition of a duck-typed model of 1,000 and of 10,000
parameters, each with a gradient and two Adam-like state tensors, which the
reporter thread does once per composition interval (10 s), and a tick that
attaches a composition to each of 8 devices against one that does not.

With --torch (PyTorch installed), the same read on a real CPU model with
torch.optim.Adam after one step, checked against the bytes PyTorch reports
for its parameters, gradients and optimizer state (the public path counts
CUDA tensors only; this one counts CPU tensors through an internal switch).
PyPI's torch 2.x for Linux x86-64 imports only with its CUDA wheels (over
4 GB) even on a machine without a GPU; torch 1.12.1 for Python 3.10 (CUDA
bundled, 1.6 GB installed) runs it too, through the numel() x
element_size() path, as it has no untyped_storage().

Usage: python3 bench/allocator_client_cost.py [--ticks 20000] [--reads 200]
           [--composition-only] [--torch]
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
from headroom_client import _composition  # noqa: E402
from headroom_client._reporter import MAX_COMPOSITION_SHARE  # noqa: E402

GIB = 1 << 30
COMPOSITION_INTERVAL_S = 10.0


def provider():
    return [
        {"index": i, "uuid": f"GPU-{i:08x}-1111-2222-3333-444455556666",
         "allocated_bytes": 30 * GIB + i, "reserved_bytes": 50 * GIB,
         "active_bytes": 31 * GIB, "inactive_split_bytes": 3 * GIB,
         "peak_allocated_bytes": 40 * GIB, "alloc_retries": 7, "ooms": 0}
        for i in range(8)
    ]


def time_ticks(reporter, ticks):
    """Wall and CPU time of each of ``ticks`` ticks, then the reporter's
    counters; stops the reporter."""
    wall, cpu = [], []
    for _ in range(ticks):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        reporter.tick()
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - w0)
    counters = (reporter.sent, reporter.dropped, reporter.errors)
    reporter.stop()
    return wall, cpu, counters


def measure(socket_path, ticks):
    reporter = headroom_client.Reporter(socket_path, stats_provider=provider,
                                        reconnect_interval_s=5.0)
    return time_ticks(reporter, ticks)


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


# -- what counting a model's memory costs ------------------------------------


class _Device:
    __slots__ = ("type", "index")

    def __init__(self, index):
        self.type = "cuda"
        self.index = index


class _Storage:
    __slots__ = ("_nbytes", "_ptr")

    def __init__(self, nbytes, ptr):
        self._nbytes = nbytes
        self._ptr = ptr

    def nbytes(self):
        return self._nbytes

    def data_ptr(self):
        return self._ptr


class _Tensor:
    """What the counter reads of a torch.Tensor, nothing more."""

    __slots__ = ("device", "dtype", "_storage", "grad", "__weakref__")
    _next_ptr = 0x7F0000000000

    def __init__(self, numel, dtype, device):
        self.device = device
        self.dtype = dtype
        _Tensor._next_ptr += 1 << 20
        self._storage = _Storage(numel * (2 if dtype.endswith("16") else 4), _Tensor._next_ptr)
        self.grad = None

    def untyped_storage(self):
        return self._storage


class _Module:
    def __init__(self, params):
        self._params = params

    def parameters(self):
        return iter(self._params)


class _Adam:
    def __init__(self, params):
        self.state = {p: {"step": 1, "exp_avg": _Tensor(1024, "torch.float32", p.device),
                          "exp_avg_sq": _Tensor(1024, "torch.float32", p.device)}
                      for p in params}


def duck_model(n_params, devices=8):
    """n_params parameters spread over `devices` GPUs, each with a gradient
    and two Adam state tensors: 4 tensors per parameter."""
    gpus = [_Device(i) for i in range(devices)]
    params = []
    for i in range(n_params):
        dtype = "torch.bfloat16" if (i // devices) % 2 else "torch.float32"
        param = _Tensor(1024, dtype, gpus[i % devices])
        param.grad = _Tensor(1024, param.dtype, param.device)
        params.append(param)
    return _Module(params), _Adam(params)


def time_reads(models, optimizers, reads, count_cpu=False):
    wall, cpu = [], []
    for _ in range(reads):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        result = _composition.read_with_retry(models, optimizers, count_cpu)
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - w0)
    return wall, cpu, result


def report_reads(name, wall, cpu):
    cpu_median = statistics.median(cpu)
    wall_median = statistics.median(wall)
    per_second = cpu_median / COMPOSITION_INTERVAL_S
    # The reporter waits at least this long after a read of this duration.
    interval = max(COMPOSITION_INTERVAL_S, wall_median / 1e9 / MAX_COMPOSITION_SHARE)
    print(f"{name:<34} wall median {wall_median / 1000:9.1f} us  p99 {p99(wall) / 1000:9.1f} us  "
          f"CPU median {cpu_median / 1000:9.1f} us  -> {per_second / 1000:7.1f} us/s, "
          f"{per_second / 1e9 * 100:.4f} % of a core at one read per {COMPOSITION_INTERVAL_S:g} s"
          + ("" if interval == COMPOSITION_INTERVAL_S else
             f" (the reporter reads every {interval:.0f} s instead: "
             f"{cpu_median / interval / 1e9 * 100:.4f} %)"))


def measure_composition(args):
    print(f"composition reads: {args.reads} per case, duck-typed tensors on 8 devices, "
          f"4 tensors per parameter (itself, its gradient, 2 Adam states)")
    for n in (1000, 10000):
        model, optimizer = duck_model(n)
        wall, cpu, result = time_reads([model], [optimizer], args.reads)
        counted = sum(sum(part.values()) for device in result.values() for part in device.values())
        expected = sum(2 * p._storage.nbytes() + 2 * 4096 for p in model.parameters())
        assert counted == expected, (counted, expected)
        report_reads(f"read, {n:,} parameters", wall, cpu)

    # What a tick pays for carrying the cached composition (no agent, so no
    # agent build is needed: the difference is the encoding).
    model, optimizer = duck_model(1000)
    for name, kwargs in (("tick, no agent, no composition", {}),
                         ("tick, no agent, compositions", {"model": model, "optimizer": optimizer})):
        reporter = headroom_client.Reporter(os.path.join(tempfile.gettempdir(), "headroom-missing.sock"),
                                            stats_provider=provider, reconnect_interval_s=3600, **kwargs)
        reporter.tick()  # the first tick counts; the rest only attach
        report(name, *time_ticks(reporter, args.ticks))


def measure_torch(args):
    try:
        import torch
    except ImportError:
        raise SystemExit("--torch needs PyTorch: pip install torch")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CPU tensors (counted through count_cpu=True)")
    cases = (
        ("MLP 256-1024-256", lambda: torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))),
        ("500 x Linear(16, 16)", lambda: torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(500))),
        ("5,000 x Linear(16, 16)", lambda: torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(5000))),
    )
    for name, build in cases:
        model = build()
        params = list(model.parameters())
        optimizer = torch.optim.Adam(params, lr=1e-3)
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()
        optimizer.step()

        wall, cpu, result = time_reads([model], [optimizer], args.reads, count_cpu=True)
        got = result[_composition.CPU_INDEX]

        def total(part):
            return sum(got[part].values())

        want_params = sum(p.numel() * p.element_size() for p in params)
        want_grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
        want_state = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                         for v in s.values() if torch.is_tensor(v))
        ok = (total("params"), total("grads"), total("optimizer")) == (want_params, want_grads, want_state)
        print(f"{name} ({len(params):,} parameters): params {total('params'):,} B (torch {want_params:,}), "
              f"grads {total('grads'):,} B (torch {want_grads:,}), optimizer {total('optimizer'):,} B "
              f"(torch {want_state:,}: exp_avg, exp_avg_sq and the step counts) -> "
              f"{'match' if ok else 'MISMATCH'}")
        report_reads(f"read, torch, {len(params):,} parameters", wall, cpu)
        # The public path counts CUDA tensors only: nothing of a CPU model.
        ok = ok and _composition.read_with_retry([model], [optimizer]) == {}
        if not ok:
            raise SystemExit(f"composition does not match PyTorch's own figures: {got}")


def measure_ticks(args):
    work = Path(tempfile.mkdtemp(prefix="headroom-alloc-bench-"))

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=20000)
    parser.add_argument("--reads", type=int, default=200, help="composition reads per case")
    parser.add_argument("--composition-only", action="store_true",
                        help="skip the agent cases (which build the agent with cargo)")
    parser.add_argument("--torch", action="store_true",
                        help="also check and time the count on a real PyTorch CPU model")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.ticks} ticks per case, 8 devices per report")
    if not args.composition_only:
        measure_ticks(args)
    measure_composition(args)
    if args.torch:
        measure_torch(args)


if __name__ == "__main__":
    main()
