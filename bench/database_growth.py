#!/usr/bin/env python3
"""How fast the database grows as a new user runs Headroom on Postgres.

Runs, side by side in one go, one `headroom-collector serve` per setup,
each on a database of its own on the same Postgres server, each fed by the
demo fleet's four nodes as four `headroom-agent --source sim` processes
(32 GPUs and 3 MIG instances, their processes, 1 sample a second), and
reads every database's size every 10 s. After a warm-up (registration,
the first flushes and minute rollups) it fits a line to each database's
size over the window and prints its slope per device-second (a device is a
GPU or a MIG instance), everything included (tables, indexes, TOAST, free
space the tables hold), and the tables that grew most. Beside it, per
device-second over the same window: the write-ahead log the database's
statements wrote (`pg_stat_statements`, on the throwaway cluster or where
the server has it loaded), and the CPU of the collector and of its
database's Postgres connections (`/proc`; a connection that closed within
the window is left out).

    python3 bench/database_growth.py [--minutes 3] [--warmup-s 150] \
        [--setup chunks] [--setup rows] [--setup before=DIR] ...

A setup is `chunks` or `rows` (this build, `[storage] sample_writes`), or
`NAME=DIR`: the `headroom-collector` and `headroom-agent` binaries in DIR,
run with their defaults (an earlier build). The default is `chunks` and
`rows`.

The databases live on a throwaway cluster with Postgres' stock settings
(`initdb`, `pg_ctl`; as root, run as the `postgres` user), so autovacuum
reclaims what updates leave behind as it would in production; `--server
URL` uses a running server instead (a role that may create databases) and
says whether its autovacuum is on, and `--sqlite` puts each collector on
an SQLite file, as the demo does. Needs `psql`. Build first:
`cargo build --release -p headroom-collector -p headroom-agent`.
"""

import argparse
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "target" / "release"
SIM_NODES = ["gpu-node-01", "gpu-node-02", "k8s-gpu-03", "gpu-node-04"]
READ_EVERY_S = 10


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_database(url, name):
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def psql(url, sql):
    out = subprocess.run(
        ["psql", "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", sql],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


def postgres_tool(name):
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if not versions:
        sys.exit(f"{name} not found: install postgresql, or pass --server URL")
    return str(versions[-1])


class ThrowawayCluster:
    """A Postgres cluster with stock settings in a temporary folder."""

    def __init__(self, work):
        self.dir = work / "pgdata"
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.port = free_port()
        work.chmod(0o755)
        self.dir.mkdir()
        if self.as_postgres:
            shutil.chown(self.dir, "postgres")
        self.tool("initdb", "-D", str(self.dir), "-A", "trust", "-U", "postgres", "--no-sync")
        # pg_stat_statements counts each statement's WAL by database; it
        # changes nothing the collectors write. Where it is not installed
        # the WAL column stays empty.
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        statements = " -c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.max=10000"
        try:
            self.start(options + statements)
        except subprocess.CalledProcessError:
            print("pg_stat_statements not available: no WAL figures")
            self.start(options)
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        try:
            psql(self.url, "CREATE EXTENSION pg_stat_statements")
        except subprocess.CalledProcessError:
            pass

    def start(self, options):
        self.tool("pg_ctl", "-D", str(self.dir), "-w", "-l", str(self.dir / "postgres.log"),
                  "-o", options, "start")

    def tool(self, name, *args):
        subprocess.run(self.as_postgres + [postgres_tool(name), *args], check=True,
                       stdout=subprocess.DEVNULL)

    def stop(self):
        self.tool("pg_ctl", "-D", str(self.dir), "-m", "fast", "stop")


def parse_setup(text):
    if text in ("chunks", "rows"):
        return text, RELEASE, text
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        sys.exit(f"setup {text!r}: expected chunks, rows or NAME=DIR")
    return name, Path(directory), None


class PostgresDatabase:
    """A database of its own on the server at `admin_url`."""

    def __init__(self, name, admin_url):
        self.name = f"headroom_growth_{name}_{os.getpid()}".replace("-", "_")
        self.admin_url = admin_url
        self.url = with_database(admin_url, self.name)

    def create(self):
        psql(self.admin_url, f'CREATE DATABASE "{self.name}"')

    def size(self):
        return int(psql(self.url, "SELECT pg_database_size(current_database())"))

    def devices(self):
        return int(psql(self.url, "SELECT count(*) FROM devices"))

    def tables(self):
        """Each table's size with its indexes and TOAST, and its rows
        inserted, updated and of those updated in place (HOT) so far."""
        rows = psql(self.url, "SELECT c.relname, pg_total_relation_size(c.oid), "
                              "COALESCE(s.n_tup_ins, 0), COALESCE(s.n_tup_upd, 0), "
                              "COALESCE(s.n_tup_hot_upd, 0) FROM pg_class c "
                              "JOIN pg_namespace n ON n.oid = c.relnamespace "
                              "LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
                              "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')")
        tables = {}
        for line in rows.splitlines():
            name, *figures = line.split("|")
            tables[name] = [int(f) for f in figures]
        return tables

    def work(self):
        """The WAL bytes its statements wrote so far (None where the server
        has no pg_stat_statements), and its connections' CPU seconds so
        far (None where the server is not on this machine)."""
        try:
            wal = int(psql(self.admin_url,
                           "SELECT COALESCE(sum(s.wal_bytes), 0)::int8 FROM pg_stat_statements s "
                           f"JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{self.name}'"))
        except subprocess.CalledProcessError:
            wal = None
        # The collector's connections only: autovacuum and parallel workers
        # come and go within the window.
        backends = psql(self.admin_url,
                        "SELECT pid || ':' || extract(epoch FROM backend_start) FROM pg_stat_activity "
                        f"WHERE datname = '{self.name}' AND backend_type = 'client backend' "
                        "AND pid <> pg_backend_pid()")
        cpu = {}
        for backend in backends.split():
            pid = int(backend.split(":")[0])
            if not is_postgres(pid):
                return wal, None  # the server is not on this machine
            seconds = cpu_seconds(pid)
            if seconds is not None:  # None: it closed since the query
                cpu[backend] = seconds
        return wal, cpu

    def drop(self):
        try:
            psql(self.admin_url, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        except subprocess.CalledProcessError as error:
            print(f"could not drop {self.name}: {error.stderr}")


class SqliteDatabase:
    """An SQLite file, as the demo keeps. Its write-ahead log is left out:
    it grows to about 4 MB between checkpoints and is then reused, so it
    is a bound, not growth."""

    def __init__(self, folder):
        self.path = folder / "headroom.db"
        self.url = f"sqlite://{self.path}"

    def create(self):
        pass

    def size(self):
        return self.path.stat().st_size

    def work(self):
        return None, None

    def read(self, sql):
        with sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10) as db:
            return db.execute(sql).fetchall()

    def devices(self):
        return self.read("SELECT count(*) FROM devices")[0][0]

    def tables(self):
        """Each table's pages with its indexes' (SQLite keeps no counts of
        inserts and updates)."""
        rows = self.read("SELECT m.tbl_name, sum(s.pgsize) FROM dbstat s "
                         "JOIN sqlite_master m ON m.name = s.name GROUP BY m.tbl_name")
        return {name: [size, 0, 0, 0] for name, size in rows}

    def drop(self):
        pass


class Setup:
    def __init__(self, name, binaries, sample_writes, admin_url, work):
        self.name = name
        self.binaries = binaries
        for binary in ("headroom-collector", "headroom-agent"):
            if not (binaries / binary).is_file():
                sys.exit(f"setup {name}: {binaries / binary} is missing; build it first")
        self.dir = work / name
        self.dir.mkdir()
        self.database = PostgresDatabase(name, admin_url) if admin_url else SqliteDatabase(self.dir)
        self.sample_writes = sample_writes
        self.processes = []
        self.sizes = []  # (seconds since the window opened, bytes)
        self.work = []  # the database's and the collector's, at open and close

    def start(self):
        self.database.create()
        grpc = free_port()
        command = [str(self.binaries / "headroom-collector"), "serve",
                   "--grpc-listen", f"127.0.0.1:{grpc}",
                   "--http-listen", f"127.0.0.1:{free_port()}"]
        if self.sample_writes:
            config = self.dir / "collector.toml"
            config.write_text(f'[storage]\nsample_writes = "{self.sample_writes}"\n')
            command[2:2] = ["--config", str(config)]
        self.spawn(command, "collector.log", HEADROOM_DATABASE_URL=self.database.url)
        for node in SIM_NODES:
            spool = self.dir / f"spool-{node}"
            spool.mkdir()
            self.spawn([str(self.binaries / "headroom-agent"),
                        "--source", "sim", "--sim-node", node, "--node-name", node,
                        "--collector-url", f"http://127.0.0.1:{grpc}",
                        "--metrics-listen", f"127.0.0.1:{free_port()}",
                        "--no-allocator-socket", "--spool-dir", str(spool)],
                       f"agent-{node}.log")

    def spawn(self, command, log, **env):
        with open(self.dir / log, "w") as out:
            self.processes.append(subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": "warn", **env}))

    def check_running(self):
        for process in self.processes:
            if process.poll() is not None:
                sys.exit(f"setup {self.name}: {process.args[0]} exited with {process.returncode};"
                         f" logs in {self.dir}")

    def size(self):
        return self.database.size()

    def devices(self):
        return self.database.devices()

    def tables(self):
        return self.database.tables()

    def read_work(self):
        self.work.append((self.database.work(), cpu_seconds(self.processes[0].pid)))

    def stop(self):
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        self.database.drop()


def cpu_seconds(pid):
    """User and system CPU of process `pid` so far, or None where it is not
    on this machine."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_postgres(pid):
    """Whether process `pid` on this machine is a Postgres backend (or has
    just gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() in ("postgres", "postmaster")
    except (FileNotFoundError, ProcessLookupError):
        return True


def work_between(opened, closed):
    """WAL bytes and CPU seconds of the Postgres connections between two
    readings of `PostgresDatabase.work`, each connection known by its pid
    and start: one opened within the window counts whole, one closed within
    it is left out."""
    (wal_a, cpu_a), (wal_b, cpu_b) = opened, closed
    wal = None if wal_a is None or wal_b is None else wal_b - wal_a
    cpu = None if cpu_a is None or cpu_b is None else sum(
        seconds - cpu_a.get(backend, 0.0) for backend, seconds in cpu_b.items())
    return wal, cpu


def slope(points):
    """Least-squares bytes per second of (seconds, bytes) points."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (b - mean_b) for t, b in points) / var


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="the window measured")
    parser.add_argument("--warmup-s", type=float, default=150.0)
    parser.add_argument("--setup", action="append", help="chunks, rows or NAME=DIR")
    parser.add_argument("--server", help="a running Postgres server's URL instead of a throwaway cluster")
    parser.add_argument("--sqlite", action="store_true",
                        help="each collector on an SQLite file, as the demo runs, instead of Postgres")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="headroom-growth-") as work:
        cluster = None if args.server or args.sqlite else ThrowawayCluster(Path(work))
        admin_url = None if args.sqlite else args.server or cluster.url
        if admin_url:
            autovacuum = psql(admin_url, "SHOW autovacuum")
            print(f"Postgres at {urlsplit(admin_url).netloc}, autovacuum {autovacuum}")
        else:
            print("SQLite, a file per collector")
        setups = [Setup(*parse_setup(text), admin_url, Path(work))
                  for text in (args.setup or ["chunks", "rows"])]
        try:
            for setup in setups:
                setup.start()
            print(f"warming up {args.warmup_s:.0f} s: {', '.join(s.name for s in setups)}")
            time.sleep(args.warmup_s)
            for setup in setups:
                setup.check_running()
            before = {s.name: s.tables() for s in setups}
            for setup in setups:
                setup.read_work()
            opened = time.monotonic()
            while True:
                elapsed = time.monotonic() - opened
                for setup in setups:
                    setup.sizes.append((elapsed, setup.size()))
                if elapsed >= args.minutes * 60:
                    for setup in setups:
                        setup.read_work()
                    break
                time.sleep(READ_EVERY_S - (time.monotonic() - opened) % READ_EVERY_S)
            for setup in setups:
                setup.check_running()
            report(setups, before, args)
        finally:
            for setup in setups:
                setup.stop()
            if cluster:
                cluster.stop()


def report(setups, before, args):
    seconds = setups[0].sizes[-1][0]
    print(f"\ndatabase growth over {seconds:.0f} s after {args.warmup_s:.0f} s of warm-up,"
          f" a size read every {READ_EVERY_S} s, the slope of a line fitted to them:")
    print(f"{'setup':<10} {'devices':>7} {'bytes/device-s':>15} {'first to last':>15}")
    for setup in setups:
        devices = setup.devices()
        rate = slope(setup.sizes) / devices
        span = (setup.sizes[-1][1] - setup.sizes[0][1]) / seconds / devices
        print(f"{setup.name:<10} {devices:>7} {rate:>15.1f} {span:>15.1f}")
    print(f"\nper device-second over the window: WAL its statements wrote, CPU of the collector"
          f" and of its Postgres connections")
    print(f"{'setup':<10} {'WAL bytes':>10} {'collector ms':>13} {'Postgres ms':>12}")
    for setup in setups:
        devices = setup.devices()
        (db_open, collector_open), (db_close, collector_close) = setup.work
        wal, postgres_cpu = work_between(db_open, db_close)
        per = lambda x, scale: "-" if x is None else f"{x * scale / seconds / devices:.2f}"
        print(f"{setup.name:<10} {per(wal, 1):>10} "
              f"{per(collector_close - collector_open, 1000):>13} {per(postgres_cpu, 1000):>12}")
    for setup in setups:
        after = setup.tables()
        start = before[setup.name]
        change = {t: [a - b for a, b in zip(after[t], start.get(t, [0, 0, 0, 0]))] for t in after}
        grown = sorted(change, key=lambda t: change[t][0], reverse=True)
        devices = setup.devices()
        print(f"\n{setup.name}: tables that grew most, and any updated more than once a"
              f" device-minute, per device-second (first to last)")
        print(f"  {'table':<34} {'bytes':>8} {'inserts':>8} {'updates':>8} {'in place':>8}")
        for table in grown:
            growth, inserted, updated, hot = (x / seconds / devices for x in change[table])
            if (growth > 0 and table in grown[:6]) or updated * 60 > 1:
                print(f"  {table:<34} {growth:>8.1f} {inserted:>8.2f} {updated:>8.2f} {hot:>8.2f}")


if __name__ == "__main__":
    main()
