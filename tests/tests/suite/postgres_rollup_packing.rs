//! Rollups of closed spans on Postgres: minutes of closed hours moved into
//! one row per series and hour, hours of closed days into one per series
//! and day; charted, rolled up and summed for the fleet as before. A late
//! sample unpacks its series' hour of minutes; the hour it redoes for its
//! series is written beside its packed day and read in its place.
//! The next pass packs both with the rest. (That every chart of a compacted hour reads the same on both
//! backends is in the conformance suite.)

use headroom_collector::ingest::validate::{self, Limits};
use headroom_store::model::{NodeSession, StoreBatch};
use headroom_store::rollup::{DAY_MS, HOUR_MS, MINUTE_MS, StorageConfig, bucket_start};
use headroom_store::{PostgresStore, Store};
use headroom_tests::fixtures::{self, BOOT, GIB, GPU0, GPU1, NODE, now_ms};
use headroom_tests::postgres;

const STEP_MS: i64 = 10_000;

/// A batch of GPU0 and GPU1 at `ts`, their memory moving a little each
/// sample, and GPU0's one process (the same incarnation throughout).
fn two_gpus(session: &NodeSession, seq: u64, ts: i64, start_ms: i64, now: i64) -> StoreBatch {
    let mut b = fixtures::batch(seq, ts);
    let wobble = seq % 7;
    b.gpu_samples = vec![
        fixtures::gpu_sample(GPU0, ts, (20 + wobble) * GIB),
        fixtures::gpu_sample(GPU1, ts, (30 + wobble % 3) * GIB),
    ];
    b.process_samples[0].start_time_ms = start_ms;
    b.process_samples[0].memory_used_last_bytes = (12 + wobble % 2) * GIB;
    validate::batch(b, session, now, &Limits::default()).unwrap()
}

async fn loose_minutes(store: &PostgresStore, from: i64, to: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM gpu_samples_1m WHERE ts_ms >= $1 AND ts_ms < $2)
              + (SELECT count(*) FROM process_samples_1m WHERE ts_ms >= $1 AND ts_ms < $2)",
    )
    .bind(from)
    .bind(to)
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// `(rows, minutes in them)` of the packed GPU minute rollups.
async fn packed_gpu_hours(store: &PostgresStore) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), COALESCE(sum(cardinality(minute)), 0)::int8 FROM gpu_samples_1m_packed",
    )
    .fetch_one(store.pool())
    .await
    .unwrap()
}

fn four_hours_ago(now: i64) -> i64 {
    bucket_start(now - 4 * HOUR_MS, HOUR_MS)
}

/// A fresh database (`None` without Postgres) holding two hours of GPU0,
/// GPU1 and a process every 10 s from the hour `start(now)`, written by a
/// flush a minute as a collector writes them; with the node's session, the
/// time written at and the first hour.
async fn written(
    start: impl Fn(i64) -> i64,
) -> Option<(postgres::TestDatabase, PostgresStore, NodeSession, i64, i64)> {
    let db = postgres::fresh_database().await?;
    let store = PostgresStore::connect(&db.url, StorageConfig::default())
        .await
        .unwrap();
    let reg = validate::registration(&fixtures::register(NODE, BOOT), &Limits::default()).unwrap();
    let session = store.register(&reg, now_ms()).await.unwrap();
    let now = now_ms();
    let base = start(now);
    let batches: Vec<StoreBatch> = (0..(2 * HOUR_MS / STEP_MS) as u64)
        .map(|i| {
            two_gpus(
                &session,
                i + 1,
                base + i as i64 * STEP_MS,
                base - 60_000,
                now,
            )
        })
        .collect();
    for minute in batches.chunks(6) {
        store.write_batches(minute).await.unwrap();
        store.flush(true).await.unwrap();
    }
    Some((db, store, session, now, base))
}

#[tokio::test]
async fn closed_hours_minutes_pack_into_a_row_per_series_and_a_late_sample_joins_them() {
    let Some((db, store, session, now, base)) = written(four_hours_ago).await else {
        return;
    };
    let end = base + 2 * HOUR_MS;
    let minute_charts = || async {
        (
            store
                .device_series(GPU0, base, end - 1, 120)
                .await
                .unwrap()
                .unwrap(),
            store
                .process_series(GPU0, base, end - 1, 120)
                .await
                .unwrap()
                .unwrap(),
            store.fleet_history(base, end - 1, 120).await.unwrap(),
        )
    };
    let before = minute_charts().await;
    assert_eq!(before.0.len(), 120);
    let loose = loose_minutes(&store, base, end).await;
    assert_eq!(loose, 2 * 120 + 120, "two GPUs' and a process's minutes");

    let report = store.maintain(now).await.unwrap();
    assert_eq!(report.minute_rows_packed, loose as u64, "{report:?}");
    assert_eq!(
        report.hour_rows_packed, 0,
        "today's hours stay loose until tomorrow has ended"
    );
    assert_eq!(loose_minutes(&store, base, end).await, 0);
    assert_eq!(
        packed_gpu_hours(&store).await,
        (4, 240),
        "a row per GPU and hour, each with its 60 minutes"
    );
    assert_eq!(minute_charts().await, before, "the same charts, packed");
    let hours = store
        .device_series(GPU0, base, end - 1, 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(hours.len(), 2);
    assert_eq!(hours[0].memory_used_max_bytes, (27 * GIB) as i64);

    // A spike from an agent's spool, long after its hour was packed.
    let late_ts = base + 30 * MINUTE_MS + 5_000;
    let mut late = fixtures::batch(100_000, late_ts);
    late.process_samples.clear();
    late.gpu_samples = vec![fixtures::gpu_sample(GPU0, late_ts, 70 * GIB)];
    let late = validate::batch(late, &session, now, &Limits::default()).unwrap();
    store.write_batch(&late).await.unwrap();
    store.flush(true).await.unwrap();
    assert_eq!(
        loose_minutes(&store, base, base + HOUR_MS).await,
        60,
        "GPU0's hour is unpacked for the late sample, and only that"
    );
    assert_eq!(packed_gpu_hours(&store).await, (3, 180));
    let (series, _, fleet) = minute_charts().await;
    assert_eq!(series[30].samples, before.0[30].samples + 1);
    assert_eq!(series[30].memory_used_max_bytes, (71 * GIB) as i64);
    assert_eq!(series[29], before.0[29], "its neighbours unchanged");
    assert_eq!(
        fleet[30].used_max_bytes,
        before.2[30].used_max_bytes - before.0[30].memory_used_max_bytes + (71 * GIB) as i64,
        "the fleet's minute summed again with GPU1's packed minute"
    );

    let report = store.maintain(now + 1000).await.unwrap();
    assert_eq!(report.minute_rows_packed, 60, "{report:?}");
    assert_eq!(loose_minutes(&store, base, end).await, 0);
    assert_eq!(packed_gpu_hours(&store).await, (4, 240));
    let hours = store
        .device_series(GPU0, base, end - 1, 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(hours[0].memory_used_max_bytes, (71 * GIB) as i64);
    assert_eq!(hours[0].samples, 361);
    let (series, _, fleet) = minute_charts().await;
    assert_eq!(series[30].memory_used_max_bytes, (71 * GIB) as i64);
    assert_eq!(
        fleet[30].used_max_bytes,
        before.2[30].used_max_bytes - before.0[30].memory_used_max_bytes + (71 * GIB) as i64
    );
    assert_eq!(
        store.maintain(now + 2000).await.unwrap().minute_rows_packed,
        0,
        "nothing left to pack"
    );
    db.drop_database().await;
}

/// A loose rollup row of GPU1 in `table` for the bucket at `ts`, `step_ms`
/// long: `samples` samples at 75 GiB, as a collector older than packing
/// writes one during a rolling upgrade.
async fn write_loose_gpu1_rollup(
    store: &PostgresStore,
    table: &str,
    ts: i64,
    step_ms: i64,
    samples: i32,
) {
    sqlx::query(&format!(
        "INSERT INTO {table} (device_id, ts_ms, last_ts_ms, samples, used_min, used_max,
             used_avg, used_last, reserved, total, utilization, pcie_tx, pcie_rx)
         SELECT id, $1, $1 + $2 - 1000, $3, $4, $4, $4, $4, 0, 0, NULL, NULL, NULL
         FROM devices WHERE uuid = $5"
    ))
    .bind(ts)
    .bind(step_ms)
    .bind(samples)
    .bind((75 * GIB) as i64)
    .bind(GPU1)
    .execute(store.pool())
    .await
    .unwrap();
}

/// A minute merged loose into a packed hour, as a collector older than
/// packing merges one during a rolling upgrade: the next pass merges it
/// with the packed minute and packs the hour whole, rather than failing on
/// the hour's key.
#[tokio::test]
async fn a_loose_minute_beside_its_packed_hour_is_merged_when_the_hour_is_packed_again() {
    let Some((db, store, _, now, base)) = written(four_hours_ago).await else {
        return;
    };
    store.maintain(now).await.unwrap();
    let minute = base + 10 * MINUTE_MS;
    let read = || async {
        store
            .device_series(GPU1, minute, minute + MINUTE_MS - 1, 1)
            .await
            .unwrap()
            .unwrap()
    };
    let before = read().await;
    assert_eq!(before[0].samples, 6);
    write_loose_gpu1_rollup(&store, "gpu_samples_1m", minute, MINUTE_MS, 1).await;
    sqlx::query("INSERT INTO compact_pending (hour_ms) VALUES ($1)")
        .bind(base)
        .execute(store.pool())
        .await
        .unwrap();

    let report = store.maintain(now + 1000).await.unwrap();
    assert_eq!(report.minute_rows_packed, 60, "{report:?}");
    assert_eq!(loose_minutes(&store, base, base + HOUR_MS).await, 0);
    assert_eq!(packed_gpu_hours(&store).await, (4, 240));
    let after = read().await;
    assert_eq!(after[0].samples, 7);
    assert_eq!(after[0].memory_used_max_bytes, (75 * GIB) as i64);
    assert_eq!(
        after[0].memory_used_min_bytes,
        before[0].memory_used_min_bytes
    );
    db.drop_database().await;
}

/// A process's packed hour is what an operator pays for its minutes for
/// 90 days: every array of it is compressed and kept in its row, however
/// many partitions maintenance created since the upgrade. (Postgres' own
/// default compresses a row only until it fits in 2 kB: about 1.8 kB.)
#[tokio::test]
async fn a_process_packed_hour_is_compressed_whole_in_its_row() {
    let Some((db, store, _, now, _)) = written(four_hours_ago).await else {
        return;
    };
    store.maintain(now).await.unwrap();
    let (rows, largest): (i64, i32) = sqlx::query_as(
        "SELECT count(*), max(pg_column_size(p.*)) FROM process_samples_1m_packed p",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(rows, 2, "the process's two hours");
    assert!(largest < 700, "a packed process hour takes {largest} bytes");
    let toasted: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(pg_relation_size(c.reltoastrelid)), 0)::int8
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'process_samples_1m_packed'::regclass AND c.reltoastrelid <> 0",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(toasted, 0, "no array moved out of its row");
    db.drop_database().await;
}

/// `(loose, packed)` hour rollup rows of GPUs and processes in `[from, to)`,
/// a packed row counting each of its hours.
async fn hour_rows(store: &PostgresStore, from: i64, to: i64) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM gpu_samples_1h WHERE ts_ms >= $1 AND ts_ms < $2)
                  + (SELECT count(*) FROM process_samples_1h WHERE ts_ms >= $1 AND ts_ms < $2),
                (SELECT COALESCE(sum(cardinality(hour)), 0) FROM gpu_samples_1h_packed
                     WHERE day_ms >= $1 AND day_ms < $2)::int8
                  + (SELECT COALESCE(sum(cardinality(hour)), 0) FROM process_samples_1h_packed
                     WHERE day_ms >= $1 AND day_ms < $2)::int8",
    )
    .bind(from)
    .bind(to)
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// Hour rollups are kept two years: once the day after theirs has ended,
/// a day's hours move into one row per series and day, charted and summed
/// for the fleet from there. A late sample (a spool replayed days later)
/// redoes its GPU's hour beside the packed day, without unpacking it, and
/// sums the fleet's hour again; the same pass folds the redone hour into
/// that GPU's row, the other series' rows untouched.
#[tokio::test]
async fn a_closed_days_hours_pack_into_a_row_per_series_and_a_redone_hour_joins_them() {
    let Some((db, store, session, now, base)) =
        written(|now| bucket_start(now, DAY_MS) - 2 * DAY_MS + 10 * HOUR_MS).await
    else {
        return;
    };
    let day = bucket_start(base, DAY_MS);
    let day_charts = || async {
        let fleet = store
            .fleet_history(day, day + DAY_MS - 1, 24)
            .await
            .unwrap();
        let fleet_peak = |hour: i64| {
            fleet
                .iter()
                .find(|b| b.timestamp_ms == hour + HOUR_MS - 1)
                .map(|b| (b.devices, b.used_max_bytes / GIB as i64))
        };
        (
            store
                .device_series(GPU0, day, day + DAY_MS - 1, 24)
                .await
                .unwrap()
                .unwrap(),
            store
                .process_series(GPU0, day, day + DAY_MS - 1, 24)
                .await
                .unwrap()
                .unwrap(),
            [fleet_peak(base), fleet_peak(base + HOUR_MS)],
        )
    };

    let report = store.maintain(now).await.unwrap();
    assert_eq!(
        report.hour_rows_packed, 6,
        "2 GPUs' and a process's 2 hours: {report:?}"
    );
    assert_eq!(hour_rows(&store, day, day + DAY_MS).await, (0, 6));
    let (series, processes, fleet) = day_charts().await;
    assert_eq!(series.len(), 2, "the two hours with samples: {series:?}");
    assert_eq!(series[0].samples, 360);
    assert_eq!(series[0].memory_used_max_bytes, (27 * GIB) as i64);
    assert_eq!(processes.len(), 1, "{processes:?}");
    let hours: Vec<i64> = processes[0].points.iter().map(|p| p.0).collect();
    assert_eq!(hours, [base + HOUR_MS - 1, base + 2 * HOUR_MS - 1]);
    assert!(
        processes[0].points.iter().all(|p| p.1 >= (13 * GIB) as i64),
        "the process's peaks: {processes:?}"
    );
    assert_eq!(
        fleet,
        [Some((2, 27 + 33)), Some((2, 27 + 33))],
        "both GPUs' peaks summed"
    );

    // A spike from an agent's spool, two days late.
    let late_ts = base + 30 * MINUTE_MS + 5_000;
    let mut late = fixtures::batch(100_000, late_ts);
    late.process_samples.clear();
    late.gpu_samples = vec![fixtures::gpu_sample(GPU0, late_ts, 70 * GIB)];
    let late = validate::batch(late, &session, now, &Limits::default()).unwrap();
    store.write_batch(&late).await.unwrap();
    store.flush(true).await.unwrap();
    let report = store.maintain(now + 1000).await.unwrap();
    assert_eq!(
        report.hour_rows_packed, 1,
        "GPU0's redone hour folded into its day, nothing unpacked or redone for the others: {report:?}"
    );
    assert_eq!(hour_rows(&store, day, day + DAY_MS).await, (0, 6));
    let (after, after_processes, after_fleet) = day_charts().await;
    assert_eq!(after[0].samples, 361);
    assert_eq!(after[0].memory_used_max_bytes, (71 * GIB) as i64);
    assert_eq!(after[1], series[1], "the next hour unchanged");
    assert_eq!(after_processes, processes);
    assert_eq!(
        after_fleet,
        [Some((2, 71 + 33)), Some((2, 27 + 33))],
        "the fleet's hour summed again over both GPUs"
    );
    assert_eq!(
        store.maintain(now + 2000).await.unwrap().hour_rows_packed,
        0,
        "nothing left to pack"
    );
    let marked: i64 = sqlx::query_scalar("SELECT count(*) FROM hour_packing_pending")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(marked, 0, "no day left marked");
    db.drop_database().await;
}

/// An hour redone loose beside its packed day, as a leader older than day
/// packing redoes one during a rolling upgrade: the hour tables' trigger
/// marks the day. Charts read the loose hour in place of its packed copy,
/// rather than both, and the next pass folds it into the day's row.
#[tokio::test]
async fn an_hour_redone_loose_beside_its_packed_day_replaces_its_packed_copy() {
    let Some((db, store, _, now, base)) =
        written(|now| bucket_start(now, DAY_MS) - 3 * DAY_MS + 5 * HOUR_MS).await
    else {
        return;
    };
    let day = bucket_start(base, DAY_MS);
    assert_eq!(store.maintain(now).await.unwrap().hour_rows_packed, 6);
    let read = || async {
        store
            .device_series(GPU1, day, day + DAY_MS - 1, 24)
            .await
            .unwrap()
            .unwrap()
    };
    let before = read().await;
    assert_eq!(before.len(), 2);
    write_loose_gpu1_rollup(&store, "gpu_samples_1h", base, HOUR_MS, 999).await;
    assert_eq!(hour_rows(&store, day, day + DAY_MS).await, (1, 6));
    let beside = read().await;
    assert_eq!(beside.len(), 2, "one point an hour: {beside:?}");
    assert_eq!(beside[0].samples, 999, "the loose hour alone: {beside:?}");
    assert_eq!(beside[0].memory_used_max_bytes, (75 * GIB) as i64);
    assert_eq!(beside[1], before[1]);

    let report = store.maintain(now + 1000).await.unwrap();
    assert_eq!(
        report.hour_rows_packed, 1,
        "the loose hour folded into GPU1's day: {report:?}"
    );
    assert_eq!(hour_rows(&store, day, day + DAY_MS).await, (0, 6));
    assert_eq!(read().await, beside, "the day reads the same packed");
    db.drop_database().await;
}
