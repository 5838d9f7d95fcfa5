//! SQLite's chunks beyond what the conformance suite holds both stores to:
//! a collector that dies with samples in open chunks, the upgrade from
//! rows, a chunk that no longer decodes, and the upgrade that gives
//! allocator chunks their minutes (reading them: `allocator_minutes.rs`). The file is opened beside the
//! store, as an operator's `sqlite3` would.

use std::sync::Arc;

use headroom_collector::ingest::validate::{self, Limits};
use headroom_proto::v1 as pb;
use headroom_store::model::{NodeSession, StoreBatch, WriteOutcome};
use headroom_store::rollup::{HOUR_MS, MINUTE_MS, SampleWrites, StorageConfig, bucket_start};
use headroom_store::{AllocatorSeriesQuery, Store, connect_with};
use headroom_tests::fixtures::{self, BOOT, GIB, GPU0, NODE, now_ms};
use sqlx::SqlitePool;

struct Db {
    url: String,
    _dir: tempfile::TempDir,
}

impl Db {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self {
            url: format!("sqlite://{}", dir.path().join("headroom.db").display()),
            _dir: dir,
        }
    }

    async fn open(&self, sample_writes: SampleWrites) -> Arc<dyn Store> {
        let storage = StorageConfig {
            sample_writes,
            ..StorageConfig::default()
        };
        connect_with(&self.url, storage).await.unwrap()
    }

    /// The file as `sqlite3` sees it.
    async fn inspect(&self) -> SqlitePool {
        SqlitePool::connect(&self.url).await.unwrap()
    }
}

async fn register(store: &dyn Store) -> NodeSession {
    let reg = validate::registration(&fixtures::register(NODE, BOOT), &Limits::default()).unwrap();
    store.register(&reg, now_ms()).await.unwrap()
}

/// GPU0 and GPU1 at `ts`, a process on GPU0, and an XID event.
fn sent_batch(seq: u64, ts: i64) -> pb::Batch {
    let mut b: pb::Batch = fixtures::batch(seq, ts);
    b.events = vec![pb::Event {
        kind: pb::EventKind::Xid as i32,
        timestamp_ms: ts,
        uuid: GPU0.into(),
        code: 31,
        pid: 777,
        detail: "MMU fault".into(),
    }];
    b
}

fn batch(session: &NodeSession, seq: u64, ts: i64) -> StoreBatch {
    validate::batch(sent_batch(seq, ts), session, now_ms(), &Limits::default()).unwrap()
}

/// [`batch`] with a job on GPU0 that started at `job_start` and reports its
/// allocator (allocated = `seq` GiB).
fn reporting_batch(session: &NodeSession, seq: u64, ts: i64, job_start: i64) -> StoreBatch {
    job_batch(session, seq, ts, job_start, seq)
}

/// [`reporting_batch`] with `allocated_gib` allocated.
fn job_batch(
    session: &NodeSession,
    seq: u64,
    ts: i64,
    job_start: i64,
    allocated_gib: u64,
) -> StoreBatch {
    let mut b = sent_batch(seq, ts);
    let mut job = fixtures::process_sample(GPU0, ts, 900, 20 * GIB);
    job.start_time_ms = job_start;
    job.allocator = Some(pb::AllocatorStats {
        timestamp_ms: ts - 10,
        allocated_bytes: allocated_gib * GIB,
        reserved_bytes: 100 * GIB,
        active_bytes: allocated_gib * GIB,
        inactive_split_bytes: 0,
        peak_allocated_bytes: 100 * GIB,
        alloc_retries: 0,
        ooms: 0,
        composition: None,
    });
    b.process_samples.push(job);
    validate::batch(b, session, now_ms(), &Limits::default()).unwrap()
}

/// The job's allocator chart: allocated GiB of each report.
async fn job_reports(store: &dyn Store, from: i64, to: i64) -> Vec<i64> {
    store
        .allocator_series(&AllocatorSeriesQuery {
            device_uuid: GPU0,
            pid: 900,
            start_time_ms: None,
            from_ms: from,
            to_ms: to,
            max_points: 10_000,
        })
        .await
        .unwrap()
        .unwrap()
        .points
        .iter()
        .map(|p| p.allocated_bytes / GIB as i64)
        .collect()
}

/// The store's id of GPU0.
async fn gpu0_id(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT id FROM devices WHERE uuid = ?1")
        .bind(GPU0)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn count(pool: &SqlitePool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn gpu0_samples(store: &dyn Store, from: i64, to: i64) -> Vec<i64> {
    store
        .device_series(GPU0, from, to, 10_000)
        .await
        .unwrap()
        .unwrap()
        .iter()
        .map(|p| p.timestamp_ms)
        .collect()
}

/// A collector killed with batches accepted but not flushed loses only
/// their samples, which the agent still holds: after a restart the agent
/// learns the durable mark, resends what is past it, and every sample ends
/// on disk once.
#[tokio::test]
async fn a_collector_that_dies_gets_its_open_samples_again_from_the_agent() {
    let db = Db::new();
    let start = now_ms() - 60_000;
    let store = db.open(SampleWrites::Chunks).await;
    let session = register(&*store).await;
    for seq in 1..=5 {
        let b = batch(&session, seq, start + seq as i64 * 1000);
        assert_eq!(
            store.write_batch(&b).await.unwrap(),
            WriteOutcome::Committed
        );
    }
    store.flush(true).await.unwrap();
    for seq in 6..=10 {
        store
            .write_batch(&batch(&session, seq, start + seq as i64 * 1000))
            .await
            .unwrap();
    }
    assert_eq!(store.durable_seq(session.node_id, BOOT), Some(5));
    // Dropped without close, as SIGKILL leaves it: nothing more is written.
    drop(store);

    let store = db.open(SampleWrites::Chunks).await;
    let session = register(&*store).await;
    assert_eq!((session.committed_seq, session.durable_seq), (10, 5));
    let pool = db.inspect().await;
    let events_before = count(&pool, "SELECT count(*) FROM events").await;
    for seq in 6..=10 {
        let b = batch(&session, seq, start + seq as i64 * 1000);
        assert_eq!(store.write_batch(&b).await.unwrap(), WriteOutcome::Replayed);
    }
    assert_eq!(events_before, 10);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM events").await,
        events_before,
        "a replay takes samples again, not events"
    );
    let b = batch(&session, 11, start + 11_000);
    assert_eq!(
        store.write_batch(&b).await.unwrap(),
        WriteOutcome::Committed
    );
    store.flush(true).await.unwrap();
    assert_eq!(store.durable_seq(session.node_id, BOOT), Some(11));
    let expected: Vec<i64> = (1..=11).map(|s| start + s * 1000).collect();
    assert_eq!(gpu0_samples(&*store, start, start + 20_000).await, expected);
    let stored: i64 =
        sqlx::query_scalar("SELECT SUM(samples) FROM gpu_samples_packed WHERE device_id = ?1")
            .bind(gpu0_id(&pool).await)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(stored, 11, "each sample once");
    assert_eq!(count(&pool, "SELECT count(*) FROM gpu_samples").await, 0);
    store.close().await;
}

/// Rows written before the upgrade (or by `sample_writes = "rows"`) chart
/// beside the chunks written after it, and the durable mark carries over.
#[tokio::test]
async fn rows_written_before_the_upgrade_chart_beside_chunks() {
    let db = Db::new();
    let start = bucket_start(now_ms() - 10 * MINUTE_MS, MINUTE_MS);
    let job_start = start - MINUTE_MS;
    let store = db.open(SampleWrites::Rows).await;
    let session = register(&*store).await;
    for seq in 1..=30 {
        let ts = start + seq as i64 * 1000;
        store
            .write_batch(&reporting_batch(&session, seq, ts, job_start))
            .await
            .unwrap();
    }
    store.close().await;

    let store = db.open(SampleWrites::Chunks).await;
    let session = register(&*store).await;
    assert_eq!((session.committed_seq, session.durable_seq), (30, 30));
    for seq in 31..=90 {
        let ts = start + seq as i64 * 1000;
        store
            .write_batch(&reporting_batch(&session, seq, ts, job_start))
            .await
            .unwrap();
    }
    let expected: Vec<i64> = (1..=90).map(|s| start + s * 1000).collect();
    let end = start + 2 * MINUTE_MS;
    assert_eq!(
        gpu0_samples(&*store, start, end).await,
        expected,
        "rows and samples still held"
    );
    let reports: Vec<i64> = (1..=90).collect();
    assert_eq!(job_reports(&*store, start, end).await, reports);
    store.flush(true).await.unwrap();
    assert_eq!(
        gpu0_samples(&*store, start, end).await,
        expected,
        "rows and chunks"
    );
    assert_eq!(job_reports(&*store, start, end).await, reports);
    let pool = db.inspect().await;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM gpu_samples").await,
        30 * 2,
        "no new rows: two GPUs of the first 30 batches"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM allocator_samples").await,
        30,
        "no new rows: the first 30 reports"
    );
    store.close().await;
}

/// A chunk that no longer decodes costs its own samples and nothing else:
/// the chart is served with the rest, compaction leaves it in place for
/// whoever investigates, and the log names it.
#[tokio::test]
async fn a_damaged_chunk_costs_its_samples_and_nothing_else() {
    let db = Db::new();
    let now = now_ms();
    let hour = bucket_start(now - 3 * HOUR_MS, HOUR_MS);
    let store = db.open(SampleWrites::Chunks).await;
    let session = register(&*store).await;
    for seq in 1..=3u64 {
        let ts = hour + seq as i64 * MINUTE_MS;
        store.write_batch(&batch(&session, seq, ts)).await.unwrap();
        store.flush(true).await.unwrap();
    }
    let pool = db.inspect().await;
    sqlx::query(
        "UPDATE gpu_samples_packed SET data = X'01FF' WHERE first_ts_ms = ?1 AND device_id = ?2",
    )
    .bind(hour + 2 * MINUTE_MS)
    .bind(gpu0_id(&pool).await)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        gpu0_samples(&*store, hour, hour + HOUR_MS - 1).await,
        [hour + MINUTE_MS, hour + 3 * MINUTE_MS]
    );
    let report = store.maintain(now).await.unwrap();
    assert!(report.chunks_compacted > 0, "{report:?}");
    assert_eq!(
        gpu0_samples(&*store, hour, hour + HOUR_MS - 1).await,
        [hour + MINUTE_MS, hour + 3 * MINUTE_MS]
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM gpu_samples_packed WHERE data = X'01FF'"
        )
        .await,
        1,
        "kept, not dropped"
    );
    store.close().await;
}

/// A file whose allocator chunks were written before migration 0015 (which
/// makes the table anew, with a `minutes` column before the reports) keeps
/// them through the upgrade: the job's chart is the same after it.
#[tokio::test]
async fn allocator_chunks_written_before_their_minutes_column_chart_after_the_upgrade() {
    let db = Db::new();
    let start = bucket_start(now_ms() - 10 * MINUTE_MS, MINUTE_MS);
    let store = db.open(SampleWrites::Chunks).await;
    let session = register(&*store).await;
    for seq in 1..=90 {
        let ts = start + seq as i64 * 1000;
        store
            .write_batch(&reporting_batch(&session, seq, ts, start - MINUTE_MS))
            .await
            .unwrap();
        if seq % 45 == 0 {
            store.flush(true).await.unwrap();
        }
    }
    let end = start + 2 * MINUTE_MS;
    let reports: Vec<i64> = (1..=90).collect();
    assert_eq!(job_reports(&*store, start, end).await, reports);
    store.close().await;

    // The file as the release before left it: the table as migration 0014
    // made it, and 0015 not applied.
    let pool = db.inspect().await;
    let mut tx = pool.begin().await.unwrap();
    for statement in [
        "CREATE TABLE before_0015 (process_id BIGINT NOT NULL, hour_ms BIGINT NOT NULL,
             first_ts_ms BIGINT NOT NULL, last_ts_ms BIGINT NOT NULL, samples INTEGER NOT NULL,
             data BLOB NOT NULL)",
        "INSERT INTO before_0015 SELECT process_id, hour_ms, first_ts_ms, last_ts_ms, samples, data
             FROM allocator_samples_packed",
        "DROP TABLE allocator_samples_packed",
        "ALTER TABLE before_0015 RENAME TO allocator_samples_packed",
        "CREATE INDEX allocator_samples_packed_process_hour ON allocator_samples_packed (process_id, hour_ms)",
        "CREATE INDEX allocator_samples_packed_hour ON allocator_samples_packed (hour_ms)",
        "DELETE FROM _sqlx_migrations WHERE version = 15",
    ] {
        sqlx::query(statement)
            .execute(&mut *tx)
            .await
            .expect(statement);
    }
    tx.commit().await.unwrap();
    let chunks = count(&pool, "SELECT count(*) FROM allocator_samples_packed").await;
    assert!(chunks >= 2, "{chunks} chunks");
    pool.close().await;

    let store = db.open(SampleWrites::Chunks).await;
    assert_eq!(job_reports(&*store, start, end).await, reports);
    let pool = db.inspect().await;
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM allocator_samples_packed WHERE minutes IS NULL"
        )
        .await,
        chunks,
        "every chunk kept, none with minutes"
    );
    let columns: Vec<String> =
        sqlx::query_scalar("SELECT name FROM pragma_table_info('allocator_samples_packed')")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        columns,
        [
            "process_id",
            "hour_ms",
            "first_ts_ms",
            "last_ts_ms",
            "samples",
            "minutes",
            "data"
        ],
        "the minutes before the reports"
    );
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'allocator_samples_packed'
         ORDER BY name",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        [
            "allocator_samples_packed_hour",
            "allocator_samples_packed_process_hour"
        ]
    );
    store.close().await;
}
