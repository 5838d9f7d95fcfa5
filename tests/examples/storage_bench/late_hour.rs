//! The storage bench's phase 8, a late hour in a packed day (`late-hour`,
//! alone): AGENTS nodes of 8 GPUs, each with two processes, put straight
//! into the tables with a day three days back already packed (a row per series and day) and one hour
//! of it as packed minute rollups. That hour is then marked to be rolled up
//! again, twice: for one node's series (8 GPUs, 16 processes), as a flush
//! of that node's spool replayed days late marks it, then whole, as every
//! late flush marked it before and a fleet's replay still does. Each time
//! maintenance runs until the day is packed again: each pass's time and
//! what it did, then the passes' wall time, Postgres CPU, WAL written and
//! hour rows packed. It checks that the day's packed rows then hold the
//! hour as redone from its minutes, for the series marked, and that nothing
//! is left loose or marked.

use std::time::Instant;

use headroom_store::Store;
use headroom_store::rollup::{DAY_MS, HOUR_MS, MINUTE_MS, StorageConfig, bucket_start};
use headroom_tests::fixtures::now_ms;
use headroom_tests::postgres;
use sqlx::Connection;
use sqlx::postgres::PgConnection;

use super::{GPUS_PER_NODE, PROCESSES_PER_GPU, postmaster_of, put_fleet_in_tables};

/// Figures an array of a series' buckets holds: `n` values moving with
/// the series and the bucket.
fn figures(series: &str, n: i64, modulus: u64) -> String {
    format!(
        "(SELECT array_agg(({series}::int8 * 1000003 + b * 7919) % {modulus}) FROM generate_series(0, {}) b)",
        n - 1
    )
}

pub async fn late_hour_in_packed_day(nodes: usize) {
    let gpus = nodes * GPUS_PER_NODE;
    let processes = gpus * PROCESSES_PER_GPU;
    println!(
        "## 8. A late hour in a packed day: {nodes} nodes × {GPUS_PER_NODE} GPUs ({PROCESSES_PER_GPU} processes each)"
    );
    let db = postgres::fresh_database().await.expect("Postgres");
    let store = headroom_store::connect_with(&db.url, StorageConfig::default())
        .await
        .unwrap();
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    put_fleet_in_tables(&mut conn, nodes).await;
    let now = now_ms();
    let day = bucket_start(now, DAY_MS) - 3 * DAY_MS;
    let hour = day + 5 * HOUR_MS;
    let total = 85_899_345_920_u64;
    let setup_started = Instant::now();
    for statement in [
        format!(
            "SELECT headroom_create_partitions(t, {DAY_MS}, {day}, {day} + {DAY_MS})
             FROM unnest(ARRAY['gpu_samples_1m_packed', 'process_samples_1m_packed', 'gpu_samples_1m', 'process_samples_1m']) t"
        ),
        format!(
            "SELECT headroom_create_partitions(t, 7 * {DAY_MS}, {day}, {day} + {DAY_MS})
             FROM unnest(ARRAY['gpu_samples_1h_packed', 'process_samples_1h_packed', 'gpu_samples_1h', 'process_samples_1h']) t"
        ),
        format!(
            "INSERT INTO gpu_samples_1h_packed (day_ms, device_id, hour, last_offset_ms, samples, used_min, used_max,
                 used_avg, used_last, reserved, total, utilization, pcie_tx, pcie_rx)
             SELECT {day}, d.id, (SELECT array_agg(h::int2) FROM generate_series(0, 23) h),
                 array_fill(3599000, ARRAY[24]), array_fill(3000, ARRAY[24]), {min}, {min}, {min}, {min},
                 array_fill(536870912::int8, ARRAY[24]), array_fill({total}::int8, ARRAY[24]),
                 array_fill(50::real, ARRAY[24]), {pcie}, {pcie}
             FROM devices d",
            min = figures("d.id", 24, total),
            pcie = figures("d.id", 24, 16_000_000_000),
        ),
        format!(
            "INSERT INTO process_samples_1h_packed (day_ms, process_id, hour, last_offset_ms, samples, used_min,
                 used_max, used_avg, used_last)
             SELECT {day}, p, (SELECT array_agg(h::int2) FROM generate_series(0, 23) h),
                 array_fill(3599000, ARRAY[24]), array_fill(3600, ARRAY[24]), {used}, {used}, {used}, {used}
             FROM generate_series(1, {processes}) p",
            used = figures("p", 24, total / 2),
        ),
        format!(
            "INSERT INTO gpu_samples_1m_packed (hour_ms, device_id, minute, last_offset_ms, samples, used_min, used_max,
                 used_avg, used_last, reserved, total, utilization, pcie_tx, pcie_rx)
             SELECT {hour}, d.id, (SELECT array_agg(m::int2) FROM generate_series(0, 59) m),
                 array_fill(59000, ARRAY[60]), array_fill(60, ARRAY[60]), {used}, {used}, {used}, {used},
                 array_fill(536870912::int8, ARRAY[60]), array_fill({total}::int8, ARRAY[60]),
                 array_fill(50::real, ARRAY[60]), {pcie}, {pcie}
             FROM devices d",
            used = figures("d.id", 60, total),
            pcie = figures("d.id", 60, 16_000_000_000),
        ),
        format!(
            "INSERT INTO process_samples_1m_packed (hour_ms, process_id, minute, last_offset_ms, samples, used_min,
                 used_max, used_avg, used_last)
             SELECT {hour}, p, (SELECT array_agg(m::int2) FROM generate_series(0, 59) m),
                 array_fill(59000, ARRAY[60]), array_fill(60, ARRAY[60]), {used}, {used}, {used}, {used}
             FROM generate_series(1, {processes}) p",
            used = figures("p", 60, total / 2),
        ),
        format!(
            "INSERT INTO rollup_progress (step_ms, done_until_ms) VALUES ({MINUTE_MS}, {}), ({HOUR_MS}, {})
             ON CONFLICT (step_ms) DO UPDATE SET done_until_ms = EXCLUDED.done_until_ms",
            bucket_start(now, MINUTE_MS),
            bucket_start(now, HOUR_MS)
        ),
        "VACUUM ANALYZE".to_owned(),
    ] {
        sqlx::query(&statement).execute(&mut conn).await.unwrap();
    }
    // A first pass does what any pass does (partitions, retention) before
    // the hour is marked.
    store.maintain(now_ms()).await.unwrap();
    sqlx::query("CHECKPOINT").execute(&mut conn).await.unwrap();
    println!(
        "set up in {:.1} s: {gpus} GPU days and {processes} process days packed, and hour 5's minutes",
        setup_started.elapsed().as_secs_f64(),
    );

    let postmaster = postmaster_of(&mut conn).await;
    println!(
        "| hour 5 marked | passes | until packed again | Postgres CPU | WAL written | hour rows packed |"
    );
    println!("|---|---|---|---|---|---|");
    // One node's spool replayed late, as a flush marks it: its 8 GPUs and
    // their 16 processes.
    sqlx::query(
        "INSERT INTO hour_redo_series (hour_ms, process, series_id)
         SELECT $1, false, id FROM devices WHERE node_id = (SELECT min(id) FROM nodes)
         UNION ALL
         SELECT $1, true, p FROM generate_series(1, $2) p",
    )
    .bind(hour)
    .bind((GPUS_PER_NODE * PROCESSES_PER_GPU) as i64)
    .execute(&mut conn)
    .await
    .unwrap();
    redo_until_packed(&*store, &mut conn, postmaster, "for one node's series").await;
    check_the_day(&mut conn, day, hour, gpus, GPUS_PER_NODE).await;
    // The whole hour, as every late flush marked it before, and as a
    // fleet's replay after a collector's outage still marks it.
    sqlx::query("INSERT INTO rollup_pending (step_ms, bucket_ms) VALUES ($1, $2)")
        .bind(HOUR_MS)
        .bind(hour)
        .execute(&mut conn)
        .await
        .unwrap();
    redo_until_packed(&*store, &mut conn, postmaster, "whole").await;
    check_the_day(&mut conn, day, hour, gpus, gpus).await;
    drop(store);
    db.drop_database().await;
}

/// Runs maintenance until the marked hour is rolled up again and its day
/// packed, and prints a row of what it took.
async fn redo_until_packed(
    store: &dyn Store,
    conn: &mut PgConnection,
    postmaster: Option<u32>,
    marked: &str,
) {
    let cpu = || postmaster.and_then(headroom_tests::cpu::postgres_seconds);
    let (wal_before, cpu_before) = (wal(conn).await, cpu());
    let started = Instant::now();
    let (mut passes, mut hour_rows_packed) = (Vec::new(), 0);
    loop {
        let pass_started = Instant::now();
        let report = store.maintain(now_ms()).await.unwrap();
        passes.push(format!(
            "{:.1} s ({} rolled up, {} packed)",
            pass_started.elapsed().as_secs_f64(),
            report.hours_rolled_up,
            report.hour_rows_packed
        ));
        hour_rows_packed += report.hour_rows_packed;
        if report.hours_rolled_up + report.hour_rows_packed == 0 {
            break;
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    let postgres_s = cpu().zip(cpu_before).map(|(after, before)| after - before);
    let wal_mb = (wal(conn).await - wal_before) as f64 / 1e6;
    println!(
        "| {marked} | {} | {wall_s:.1} s | {} | {wal_mb:.0} MB | {hour_rows_packed} |",
        passes.join(" · "),
        postgres_s.map_or("not readable here".to_owned(), |s| format!("{s:.1} s")),
    );
}

/// The day holds hour 5 as redone from its minutes (3,600 samples where
/// the day had 3,000) for the `redone` GPUs so far, once, every GPU's day
/// still 24 hours, the fleet's hour summed over every GPU once, and
/// nothing left loose or marked.
async fn check_the_day(conn: &mut PgConnection, day: i64, hour: i64, gpus: usize, redone: usize) {
    let (loose, marked, redone_now, hours, fleet_devices): (i64, i64, i64, i64, i32) =
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM gpu_samples_1h) + (SELECT count(*) FROM process_samples_1h),
                 (SELECT count(*) FROM hour_packing_pending) + (SELECT count(*) FROM hour_redo_series),
                 (SELECT count(*) FROM gpu_samples_1h_packed p, unnest(p.hour, p.samples) AS h(hour, samples)
                      WHERE p.day_ms = $1 AND h.hour = 5 AND h.samples = 3600),
                 (SELECT sum(cardinality(hour)) FROM gpu_samples_1h_packed WHERE day_ms = $1)::int8,
                 (SELECT devices FROM fleet_1h WHERE ts_ms = $2)",
        )
        .bind(day)
        .bind(hour)
        .fetch_one(conn)
        .await
        .unwrap();
    assert_eq!(loose, 0, "no hour left loose");
    assert_eq!(marked, 0, "no day or series left marked");
    assert_eq!(
        redone_now, redone as i64,
        "hour 5 redone for the GPUs marked"
    );
    assert_eq!(hours, 24 * gpus as i64, "every GPU's day still 24 hours");
    assert_eq!(
        fleet_devices, gpus as i32,
        "the fleet's hour summed over every GPU once"
    );
}

/// Bytes of WAL the server has written so far.
async fn wal(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::int8")
        .fetch_one(conn)
        .await
        .unwrap()
}
