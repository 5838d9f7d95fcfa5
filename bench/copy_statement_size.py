#!/usr/bin/env python3
"""What the rows of one COPY statement cost a Postgres backend, by how many
rows the statement carries.

The collector writes each group of batches with one binary COPY per sample
table, so a statement carries as many rows as the group has; the reference
that storage_bench compares it with is one COPY of every row. This loads the
same process-sample rows into Headroom's schema (migrations/postgres) both
ways, alternated, and prints the backend's CPU time per row, read from
/proc (so Postgres must run on this machine).

    pip install 'psycopg[binary]'
    python3 bench/copy_statement_size.py "host=127.0.0.1 port=5432 user=postgres dbname=postgres" [SECONDS] [ROUNDS]

It creates and drops a database named headroom_copy_bench.
"""

import datetime
import os
import pathlib
import statistics
import sys
import time

import psycopg

DATABASE = "headroom_copy_bench"
PROCESSES = 3200  # 200 nodes × 8 GPUs × 2 processes, as in storage_bench
MIGRATIONS = pathlib.Path(__file__).resolve().parent.parent / "migrations" / "postgres"
# Rows per statement: a big group of storage_bench (49 batches × 16
# process samples), a 256-batch group (the cap), and every row at once.
STATEMENT_ROWS = [784, 4096, None]


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


def load(url, all_rows, per_statement):
    """Backend CPU seconds to COPY `all_rows`, `per_statement` rows (or all)
    per statement, each statement its own transaction."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE process_samples")
        conn.execute("CHECKPOINT")
    step = per_statement or len(all_rows)
    with psycopg.connect(url) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        conn.commit()
        before = backend_cpu_seconds(pid)
        for first in range(0, len(all_rows), step):
            with conn.cursor() as cur:
                with cur.copy(
                    "COPY process_samples (process_id, ts_ms, used_last, used_max)"
                    " FROM STDIN (FORMAT binary)"
                ) as copy:
                    copy.set_types(["int8", "int8", "int8", "int8"])
                    for row in all_rows[first : first + step]:
                        copy.write_row(row)
            conn.commit()
        return backend_cpu_seconds(pid) - before


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
    spent = {n: [] for n in STATEMENT_ROWS}
    for _ in range(rounds):
        for per_statement in STATEMENT_ROWS:
            spent[per_statement].append(load(url, all_rows, per_statement))
    print("| rows per COPY | backend CPU per round (s) | median µs per row | over one COPY |")
    print("|---|---|---|---|")
    whole = statistics.median(spent[None])
    for per_statement in STATEMENT_ROWS:
        median = statistics.median(spent[per_statement])
        rounds_s = " · ".join(f"{s:.2f}" for s in spent[per_statement])
        label = per_statement or "all"
        print(f"| {label} | {rounds_s} | {median * 1e6 / len(all_rows):.2f} | {median / whole:.2f} |")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {DATABASE} WITH (FORCE)")


if __name__ == "__main__":
    main()
