#!/usr/bin/env python3
"""What the rows of one statement cost a Postgres backend, by how many rows
the statement carries.

The collector writes each group of batches with one binary COPY per sample
table, so a statement carries as many rows as the group has; the reference
that storage_bench compares it with is one COPY of every row. This loads the
same process-sample rows into Headroom's schema (store/migrations/postgres) in
statements of several sizes, alternated, and prints the backend's CPU time
per row, read from /proc (so Postgres must run on this machine).

    pip install 'psycopg[binary]'
    python3 bench/copy_statement_size.py "host=127.0.0.1 port=5432 user=postgres dbname=postgres" [SECONDS] [ROUNDS]

It creates and drops a database named headroom_copy_bench. With
PERF_DIR=DIR, the first round also records the backend with `perf record
-e cpu-clock -g` into DIR/copy-784.data, DIR/insert-784.data and so on,
for `perf report -i`.
"""

import datetime
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import psycopg

DATABASE = "headroom_copy_bench"
PROCESSES = 3200  # 200 nodes × 8 GPUs × 2 processes, as in storage_bench
MIGRATIONS = pathlib.Path(__file__).resolve().parent.parent / "store" / "migrations" / "postgres"
# How each round loads the rows: the statement and the rows per statement.
# A big group of storage_bench (49 batches × 16 process samples), the same
# as one INSERT from arrays, a 256-batch group (the cap), every row at once.
WAYS = [("COPY", 784), ("INSERT … unnest", 784), ("COPY", 4096), ("COPY", None)]
COPY = "COPY process_samples (process_id, ts_ms, used_last, used_max) FROM STDIN (FORMAT binary)"
INSERT_UNNEST = (
    "INSERT INTO process_samples (process_id, ts_ms, used_last, used_max)"
    " SELECT * FROM unnest(%s::int8[], %s::int8[], %s::int8[], %s::int8[])"
)


def backend_cpu_seconds(pid):
    # Fields after the command name: utime and stime are the 12th and 13th.
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def create_database(admin):
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        conn.execute(f"CREATE DATABASE {DATABASE}")
    url = psycopg.conninfo.make_conninfo(admin, dbname=DATABASE)
    with psycopg.connect(url, autocommit=True) as conn:
        for migration in sorted(MIGRATIONS.glob("*.sql")):
            conn.execute(migration.read_text())
        now_ms = int(time.time() * 1000)
        conn.execute(
            "SELECT headroom_create_partitions('process_samples', 86400000, %s, %s)",
            (now_ms - 86_400_000, now_ms),
        )
    return url


def rows(seconds, start_ms):
    out = []
    for second in range(seconds):
        ts = start_ms + second * 1000
        for process in range(PROCESSES):
            used = (20 + process % 40) * (1 << 30) // 10 * 7
            out.append((process + 1, ts, used, used + (64 << 20)))
    return out


def load(url, all_rows, way, perf_to=None):
    """Backend CPU seconds to load `all_rows` the `way` of WAYS, each
    statement its own transaction; recorded by perf into `perf_to` when
    given."""
    statement, per_statement = way
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE process_samples")
        conn.execute("CHECKPOINT")
    step = per_statement or len(all_rows)
    with psycopg.connect(url) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        conn.commit()
        perf = None
        if perf_to:
            perf = subprocess.Popen(
                ["perf", "record", "-e", "cpu-clock", "-g", "-p", str(pid), "-o", perf_to],
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)  # attached before the first row
        before = backend_cpu_seconds(pid)
        for first in range(0, len(all_rows), step):
            part = all_rows[first : first + step]
            if statement == "COPY":
                with conn.cursor() as cur, cur.copy(COPY) as copy:
                    copy.set_types(["int8", "int8", "int8", "int8"])
                    for row in part:
                        copy.write_row(row)
            else:
                conn.execute(INSERT_UNNEST, [list(column) for column in zip(*part)])
            conn.commit()
        spent = backend_cpu_seconds(pid) - before
        if perf:
            perf.send_signal(signal.SIGINT)
            perf.wait()
        return spent


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    admin = sys.argv[1]
    seconds = int(sys.argv[2]) if len(sys.argv) > 2 else 150
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    url = create_database(admin)
    # Two hours ago, as storage_bench's agents: inside today's or
    # yesterday's partition.
    start_ms = (int(time.time()) - 7200) * 1000
    day = datetime.datetime.fromtimestamp(start_ms / 1000, datetime.timezone.utc)
    all_rows = rows(seconds, start_ms)
    print(f"{len(all_rows)} process-sample rows ({seconds} s of {PROCESSES} processes, from {day:%Y-%m-%d %H:%M} UTC), {rounds} rounds")
    perf_dir = os.environ.get("PERF_DIR")
    spent = {way: [] for way in WAYS}
    for round_ in range(rounds):
        for way in WAYS:
            perf_to = None
            if perf_dir and round_ == 0:
                name = f"{way[0].split()[0].lower()}-{way[1] or 'all'}"
                perf_to = os.path.join(perf_dir, f"{name}.data")
            spent[way].append(load(url, all_rows, way, perf_to))
    print("| statement | rows per statement | backend CPU per round (s) | median µs per row | over one COPY |")
    print("|---|---|---|---|---|")
    whole = statistics.median(spent[("COPY", None)])
    for way in WAYS:
        median = statistics.median(spent[way])
        rounds_s = " · ".join(f"{s:.2f}" for s in spent[way])
        print(f"| {way[0]} | {way[1] or 'all'} | {rounds_s} | {median * 1e6 / len(all_rows):.2f} | {median / whole:.2f} |")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {DATABASE} WITH (FORCE)")


if __name__ == "__main__":
    main()
