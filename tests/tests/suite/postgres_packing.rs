//! Packing cold raw GPU samples on Postgres: what it does to the tables and
//! the bytes, and what a damaged chunk costs. Raw rows are what collectors
//! wrote before chunks at write time (and what one configured with
//! `sample_writes = "rows"` still writes during a rolling upgrade): packing
//! is their way into chunks, and a collector that writes chunks reads them
//! beside its own. That a packed day charts and rolls up as before is in
//! the conformance suite.

use headroom_collector::ingest::validate::{self, Limits};
use headroom_store::model::{NodeSession, StoreBatch, WriteOutcome};
use headroom_store::rollup::{
    DAY_MS, HOUR_MS, MINUTE_MS, SampleWrites, StorageConfig, bucket_start,
};
use headroom_store::{PostgresStore, Store};
use headroom_tests::fixtures::{self, BOOT, GIB, GPU0, GPU1, NODE, now_ms};
use headroom_tests::postgres::{self, TestDatabase, day_suffix};

async fn store(db: &TestDatabase, storage: StorageConfig) -> PostgresStore {
    let storage = StorageConfig {
        sample_writes: SampleWrites::Rows,
        ..storage
    };
    PostgresStore::connect(&db.url, storage).await.unwrap()
}

async fn register(store: &dyn Store) -> NodeSession {
    let reg = validate::registration(&fixtures::register(NODE, BOOT), &Limits::default()).unwrap();
    store.register(&reg, now_ms()).await.unwrap()
}

/// Two GPUs and a process at 1 Hz for two hours from `start`, memory and
/// PCIe moving as a busy GPU's do, in batches numbered from `first_seq`.
async fn write_two_hours(
    store: &dyn Store,
    session: &NodeSession,
    first_seq: u64,
    start: i64,
    now: i64,
) {
    let batches: Vec<StoreBatch> = (0..7200u64)
        .map(|i| {
            let ts = start + i as i64 * 1000;
            let mut b = fixtures::batch(first_seq + i, ts);
            // One process throughout, its memory in allocator-sized steps.
            let p = &mut b.process_samples[0];
            p.start_time_ms = start - 60_000;
            p.memory_used_last_bytes = 12 * GIB + (i / 600) * 256 * (1 << 20);
            p.memory_used_max_bytes = p.memory_used_last_bytes;
            b.gpu_samples = [GPU0, GPU1]
                .iter()
                .enumerate()
                .map(|(g, uuid)| {
                    let wobble = (i * 7 + g as u64 * 3) % 32;
                    let mut s = fixtures::gpu_sample(uuid, ts, 20 * GIB + wobble * (2 << 20));
                    s.utilization_pct = Some(50 + (i % 47) as u32);
                    s.pcie_tx_bytes_per_s = Some((i * 7919 % 16_000) * 1024);
                    s
                })
                .collect();
            validate::batch(b, session, now, &Limits::default()).unwrap()
        })
        .collect();
    for group in batches.chunks(600) {
        store.write_batches(group).await.unwrap();
    }
}

async fn bytes(store: &PostgresStore, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(store.pool())
        .await
        .unwrap()
}

const RAW_BYTES: &str = "SELECT COALESCE(sum(pg_total_relation_size(i.inhrelid)), 0)::int8
     FROM pg_inherits i WHERE i.inhparent = 'gpu_samples'::regclass";

/// A collector on `storage` with one node registered, the clock, and 03:00
/// of the UTC day before yesterday: a day old enough to be packed.
async fn cold_day_setup(
    db: &TestDatabase,
    storage: StorageConfig,
) -> (PostgresStore, NodeSession, i64, i64) {
    let store = store(db, storage).await;
    let session = register(&store).await;
    let now = now_ms();
    let cold = bucket_start(now - 2 * DAY_MS, DAY_MS) + 3 * HOUR_MS;
    (store, session, now, cold)
}

/// A sample of GPU0 alone at `ts`, 70 GiB used, in batch `seq`.
fn late_gpu0_sample(session: &NodeSession, seq: u64, ts: i64, now: i64) -> StoreBatch {
    let mut late = fixtures::batch(seq, ts);
    late.process_samples.clear();
    late.gpu_samples = vec![fixtures::gpu_sample(GPU0, ts, 70 * GIB)];
    validate::batch(late, session, now, &Limits::default()).unwrap()
}

/// Bytes on disk of the partition of `table` for the day holding `ts_ms`.
async fn day_bytes(store: &PostgresStore, table: &str, ts_ms: i64) -> i64 {
    sqlx::query_scalar("SELECT pg_total_relation_size($1::regclass)::int8")
        .bind(format!("{table}_p{}", day_suffix(ts_ms)))
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// A day old enough is moved into one chunk per device and hour; the raw
/// partition is emptied (heap and index) and the day takes a small
/// fraction of the bytes. Recent days stay raw.
#[tokio::test]
async fn a_cold_day_moves_into_chunks_and_gives_its_bytes_back() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let (store, session, now, cold) = cold_day_setup(&db, StorageConfig::default()).await;
    let recent = bucket_start(now - 4 * HOUR_MS, MINUTE_MS);
    write_two_hours(&store, &session, 1, cold, now).await;
    let cold_raw = bytes(&store, RAW_BYTES).await;
    write_two_hours(&store, &session, 7201, recent, now).await;

    let report = store.maintain(now).await.unwrap();
    assert_eq!(
        report.samples_packed,
        3 * 7200,
        "both GPUs' and the process's cold day: {report:?}"
    );
    let chunks: Vec<(i64, i64, i32)> = sqlx::query_as(
        "SELECT device_id::int8, hour_ms, samples FROM gpu_samples_packed
         UNION ALL SELECT process_id, hour_ms, samples FROM process_samples_packed",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(chunks.len(), 6, "one chunk per series and hour: {chunks:?}");
    assert!(chunks.iter().all(|c| c.2 == 3600));
    let cold_rows: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM gpu_samples WHERE ts_ms < $1)
              + (SELECT count(*) FROM process_samples WHERE ts_ms < $1)",
    )
    .bind(cold + 3 * HOUR_MS)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(cold_rows, 0);
    let recent_rows: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM gpu_samples) + (SELECT count(*) FROM process_samples)",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(recent_rows, 3 * 7200, "the last day stays raw");
    // The cold day's partition: every partition, empty ones ahead included,
    // carries the fixed pages of its indexes.
    let packed = day_bytes(&store, "gpu_samples_packed", cold).await;
    assert!(
        packed * 5 < cold_raw,
        "packed {packed} B against {cold_raw} B raw"
    );
    // Raw, the process's 7,200 rows were about 650 kB.
    // Beyond the fixed pages of an empty partition's table and indexes.
    let process_packed = day_bytes(&store, "process_samples_packed", cold).await
        - day_bytes(&store, "process_samples_packed", now + DAY_MS).await;
    assert!(
        process_packed * 10 < 7200 * 90,
        "a steady process packs to a few bytes per sample: {process_packed} B"
    );
    assert_eq!(
        day_bytes(&store, "gpu_samples", cold).await,
        day_bytes(&store, "gpu_samples", now + DAY_MS).await,
        "the cold partition is as small as tomorrow's, still empty"
    );
    assert_eq!(
        day_bytes(&store, "process_samples", cold).await,
        day_bytes(&store, "process_samples", now + DAY_MS).await,
    );

    let again = store.maintain(now + 1000).await.unwrap();
    assert_eq!(again.samples_packed, 0, "nothing left to pack");

    // A late sample unpacks its series' hour for the rollup; the same pass
    // packs the hour again, late sample included, and empties the day.
    let late_ts = cold + 30 * MINUTE_MS + 500;
    let late = late_gpu0_sample(&session, 20_000, late_ts, now);
    store.write_batch(&late).await.unwrap();
    let report = store.maintain(now + 2000).await.unwrap();
    assert_eq!(
        (report.minutes_rolled_up, report.samples_packed),
        (1, 3601),
        "{report:?}"
    );
    let in_hour: i64 = sqlx::query_scalar(
        "SELECT sum(samples)::int8 FROM gpu_samples_packed
         WHERE device_id = (SELECT id FROM devices WHERE uuid = $2) AND hour_ms = $1",
    )
    .bind(cold)
    .bind(GPU0)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(in_hour, 3601);
    assert_eq!(
        day_bytes(&store, "gpu_samples", cold).await,
        day_bytes(&store, "gpu_samples", now + DAY_MS).await,
        "emptied again"
    );

    // Retention drops the day's chunks with its raw partition.
    let exists = |table: &'static str| {
        let name = format!("{table}_p{}", day_suffix(cold));
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert!(exists("gpu_samples_packed").await);
    let report = store.maintain(now + 6 * DAY_MS).await.unwrap();
    assert!(report.partitions_dropped >= 4, "{report:?}");
    for table in [
        "gpu_samples",
        "gpu_samples_packed",
        "process_samples",
        "process_samples_packed",
    ] {
        assert!(!exists(table).await, "{table} of the cold day is gone");
    }
    store.close().await;
    db.drop_database().await;
}

/// A day too big for one pass's packing time is packed over several
/// passes, each resuming where the last stopped; in between, half-packed
/// series chart exactly as before. With `pack_seconds_per_pass = 0` a pass
/// packs one transaction per table: one GPU, or up to eight processes.
#[tokio::test]
async fn a_day_too_big_for_one_pass_is_packed_over_several_and_charts_whole_between() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let storage = StorageConfig {
        pack_seconds_per_pass: 0,
        ..StorageConfig::default()
    };
    let (store, session, now, cold) = cold_day_setup(&db, storage).await;
    write_two_hours(&store, &session, 1, cold, now).await;
    let span = (cold, cold + 2 * HOUR_MS - 1);
    let charts = || async {
        let mut gpus = Vec::new();
        for uuid in [GPU0, GPU1] {
            gpus.push(
                store
                    .device_series(uuid, span.0, span.1, 7200)
                    .await
                    .unwrap()
                    .unwrap(),
            );
        }
        let processes = store
            .process_series(GPU0, span.0, span.1, 7200)
            .await
            .unwrap()
            .unwrap();
        (gpus, processes)
    };
    let before = charts().await;
    let raw_gpu_rows = || bytes(&store, "SELECT count(*) FROM gpu_samples");

    let first = store.maintain(now).await.unwrap();
    assert_eq!(
        first.samples_packed,
        2 * 7200,
        "one GPU, and the process: {first:?}"
    );
    assert_eq!(raw_gpu_rows().await, 7200, "the other GPU waits");
    assert_eq!(charts().await, before, "one GPU packed, one raw");

    let second = store.maintain(now + 1000).await.unwrap();
    assert_eq!(second.samples_packed, 7200, "the other GPU: {second:?}");
    assert_eq!(raw_gpu_rows().await, 0);
    assert_eq!(
        day_bytes(&store, "gpu_samples", cold).await,
        day_bytes(&store, "gpu_samples", now + DAY_MS).await,
        "emptied once the last series is packed"
    );
    let third = store.maintain(now + 2000).await.unwrap();
    assert_eq!(third.samples_packed, 0, "{third:?}");
    assert_eq!(charts().await, before);
    store.close().await;
    db.drop_database().await;
}

/// A chunk that no longer decodes costs its own hour of the chart and
/// nothing else: the chart is served and the rest of the day is in it. A
/// late sample for that hour is charted, and the minute's rollup, which
/// cannot be recomputed without the lost samples, stays as it was rather
/// than become the late sample alone.
#[tokio::test]
async fn a_damaged_chunk_costs_its_hour_and_nothing_else() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let (store, session, now, cold) = cold_day_setup(&db, StorageConfig::default()).await;
    write_two_hours(&store, &session, 1, cold, now).await;
    store.maintain(now).await.unwrap();
    sqlx::query("UPDATE gpu_samples_packed SET data = '\\x01ff' WHERE hour_ms = $1")
        .bind(cold)
        .execute(store.pool())
        .await
        .unwrap();

    let chart = store
        .device_series(GPU0, cold, cold + 2 * HOUR_MS - 1, 3000)
        .await
        .unwrap()
        .unwrap();
    let samples: i64 = chart.iter().map(|p| p.samples).sum();
    assert_eq!(samples, 3600, "the second hour, whole");
    assert!(chart.iter().all(|p| p.timestamp_ms >= cold + HOUR_MS));

    let minute_chart =
        || store.device_series(GPU0, cold + 10 * MINUTE_MS, cold + 11 * MINUTE_MS - 1, 1);
    let rolled_before = minute_chart().await.unwrap().unwrap();
    assert_eq!(rolled_before[0].samples, 60);
    let late_ts = cold + 10 * MINUTE_MS + 500;
    let late = late_gpu0_sample(&session, 7201, late_ts, now);
    store.write_batch(&late).await.unwrap();
    let report = store.maintain(now + 1000).await.unwrap();
    assert_eq!(report.minutes_rolled_up, 1, "{report:?}");
    assert_eq!(minute_chart().await.unwrap().unwrap(), rolled_before);
    let hour = store
        .device_series(GPU0, cold, cold + HOUR_MS - 1, 3600)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(hour.len(), 1, "only the late sample: {hour:?}");
    assert_eq!(hour[0].memory_used_bytes, (70 * GIB) as i64);
    let damaged: i64 =
        sqlx::query_scalar("SELECT count(*) FROM gpu_samples_packed WHERE data = '\\x01ff'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(damaged, 2, "kept for whoever investigates, not dropped");
    store.close().await;
    db.drop_database().await;
}

/// A minute whose rollup is still to be done when its day is packed keeps
/// its raw rows (the rollup reads raw rows): here the rollup job skips the
/// minute's mark because another transaction holds it, as a second
/// maintenance pass rolling that minute up would. Once the mark is free,
/// the minute is rolled up whole and the day is packed to the end.
#[tokio::test]
async fn a_minute_waiting_for_its_rollup_is_packed_only_after_it() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let (store, session, now, cold) = cold_day_setup(&db, StorageConfig::default()).await;
    write_two_hours(&store, &session, 1, cold, now).await;
    let chart = || store.device_series(GPU0, cold, cold + 2 * HOUR_MS - 1, 7200);
    let before = chart().await.unwrap().unwrap();
    let minute = cold + 45 * MINUTE_MS;
    let mut holder = store.pool().begin().await.unwrap();
    let held: i64 = sqlx::query_scalar(
        "SELECT bucket_ms FROM rollup_pending WHERE step_ms = $1 AND bucket_ms = $2 FOR UPDATE",
    )
    .bind(MINUTE_MS)
    .bind(minute)
    .fetch_one(&mut *holder)
    .await
    .unwrap();
    assert_eq!(held, minute, "the write marked the minute");

    let report = store.maintain(now).await.unwrap();
    assert_eq!(
        report.samples_packed,
        3 * 7200 - 3 * 60,
        "all but the waiting minute's rows (2 GPUs and a process): {report:?}"
    );
    let raw: Vec<i64> = sqlx::query_scalar(
        "SELECT ts_ms FROM gpu_samples UNION ALL SELECT ts_ms FROM process_samples",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(raw.len(), 3 * 60);
    assert!(raw.iter().all(|ts| bucket_start(*ts, MINUTE_MS) == minute));
    assert_eq!(
        chart().await.unwrap().unwrap(),
        before,
        "raw and packed read together"
    );

    holder.rollback().await.unwrap();
    let report = store.maintain(now + 1000).await.unwrap();
    assert_eq!(report.minutes_rolled_up, 1, "{report:?}");
    let rolled = store
        .device_series(GPU0, minute, minute + MINUTE_MS - 1, 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rolled[0].samples, 60,
        "the whole minute, not its raw rows alone"
    );
    assert_eq!(
        day_bytes(&store, "gpu_samples", cold).await,
        day_bytes(&store, "gpu_samples", now + DAY_MS).await,
        "the day is packed to the end"
    );
    assert_eq!(chart().await.unwrap().unwrap(), before);
    store.close().await;
    db.drop_database().await;
}

/// An upgrade: two hours written as rows by a collector from before chunks,
/// then one that writes chunks takes the same agent on the same database.
/// What the old one stored counts as durable (the agent forgets it, a
/// replay of it is a duplicate), the next two hours go into chunks, all
/// four chart at full resolution once each, and the old rows still pack.
#[tokio::test]
async fn rows_written_before_the_upgrade_chart_beside_chunks_and_still_pack() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let (before, session, now, cold) = cold_day_setup(&db, StorageConfig::default()).await;
    write_two_hours(&before, &session, 1, cold, now).await;
    before.close().await;

    let after = PostgresStore::connect(&db.url, StorageConfig::default())
        .await
        .unwrap();
    let session = register(&after).await;
    assert_eq!(
        (session.committed_seq, session.durable_seq),
        (7200, 7200),
        "rows were durable as they were written"
    );
    let replay = late_gpu0_sample(&session, 7200, cold, now);
    assert_eq!(
        after.write_batch(&replay).await.unwrap(),
        WriteOutcome::Duplicate {
            committed_seq: 7200
        }
    );
    write_two_hours(&after, &session, 7201, cold + 2 * HOUR_MS, now).await;
    after.flush(true).await.unwrap();
    let (raw_rows, chunk_samples): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM gpu_samples),
                (SELECT COALESCE(sum(samples), 0)::int8 FROM gpu_samples_packed)",
    )
    .fetch_one(after.pool())
    .await
    .unwrap();
    assert_eq!((raw_rows, chunk_samples), (2 * 7200, 2 * 7200));

    let chart = || after.device_series(GPU0, cold, cold + 4 * HOUR_MS - 1, 20_000);
    let whole = chart().await.unwrap().unwrap();
    assert_eq!(whole.len(), 4 * 3600, "one point a second, rows and chunks");
    assert!(whole.iter().all(|p| p.samples == 1));
    let report = after.maintain(now).await.unwrap();
    assert_eq!(
        report.samples_packed,
        2 * 7200 + 7200,
        "the old rows, GPUs and process"
    );
    assert_eq!(chart().await.unwrap().unwrap(), whole);
    after.close().await;
    db.drop_database().await;
}

/// A flush writes a chunk per series and minute; once an hour is closed,
/// maintenance folds each series' chunks of it into one. Charts read the
/// same before and after, and a late minute written into a compacted hour
/// (a spool replayed) is folded in by the next pass.
#[tokio::test]
async fn closed_hours_of_minute_chunks_are_compacted_and_chart_the_same() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let store = PostgresStore::connect(&db.url, StorageConfig::default())
        .await
        .unwrap();
    let session = register(&store).await;
    let now = now_ms();
    let start = bucket_start(now - 4 * HOUR_MS, HOUR_MS);
    let batch = |seq: u64, ts: i64| {
        let mut b = fixtures::batch(seq, ts);
        // One process throughout.
        b.process_samples[0].start_time_ms = start - 60_000;
        validate::batch(b, &session, now, &Limits::default()).unwrap()
    };
    for minute in 0..120u64 {
        let group: Vec<StoreBatch> = (0..60u64)
            .map(|s| {
                let i = minute * 60 + s;
                batch(i + 1, start + i as i64 * 1000)
            })
            .collect();
        store.write_batches(&group).await.unwrap();
        store.flush(true).await.unwrap();
    }
    let gpu0 = *session.device_ids.get(GPU0).unwrap();
    let chunks = || async {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT (SELECT count(*) FROM gpu_samples_packed WHERE device_id = $1),
                    (SELECT count(*) FROM process_samples_packed)",
        )
        .bind(gpu0 as i32)
        .fetch_one(store.pool())
        .await
        .unwrap()
    };
    assert_eq!(chunks().await, (120, 120), "a chunk per series and minute");
    let chart = || store.device_series(GPU0, start, start + 2 * HOUR_MS - 1, 10_000);
    let processes = || store.process_series(GPU0, start, start + 2 * HOUR_MS - 1, 10_000);
    let before = chart().await.unwrap().unwrap();
    let processes_before = processes().await.unwrap().unwrap();
    assert_eq!(before.len(), 7200);

    let report = store.maintain(now).await.unwrap();
    assert_eq!(
        report.chunks_compacted,
        3 * 118,
        "three series, 120 chunks into 2 each"
    );
    assert_eq!(chunks().await, (2, 2), "a chunk per series and hour");
    assert_eq!(chart().await.unwrap().unwrap(), before);
    assert_eq!(processes().await.unwrap().unwrap(), processes_before);

    let late = batch(7201, start + 500);
    store.write_batch(&late).await.unwrap();
    store.flush(true).await.unwrap();
    assert_eq!(chunks().await, (3, 3));
    store.maintain(now + 1000).await.unwrap();
    assert_eq!(chunks().await, (2, 2), "the late chunk folded in");
    let after = chart().await.unwrap().unwrap();
    assert_eq!(after.iter().map(|p| p.samples).sum::<i64>(), 7201);
    store.close().await;
    db.drop_database().await;
}
