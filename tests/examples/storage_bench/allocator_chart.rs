//! The storage bench's phase 9, allocator charts over days
//! (`allocator-chart`, alone): one GPU with six processes whose
//! allocators report every second, as many as a GPU's page charts, for
//! DAYS (the SECONDS argument, at most 7, the raw retention; the first
//! hour and the last one before now left out) through the
//! store's write path, the open chunks written every simulated minute and
//! maintenance run until the closed hours are compacted. Then ROUNDS times
//! each (default 100): the page's read of all six series at once (its
//! `Promise.all`) and one series alone, at 600 points, over the last hour,
//! the last day and every day loaded. On Postgres and on SQLite, one after
//! the other. The charts end where the loaded hours end, an hour before
//! the last whole hour, so that they read the same chunks whenever the
//! bench runs.

use std::time::Instant;

use headroom_collector::ingest::validate::{self, Limits};
use headroom_proto::v1 as pb;
use headroom_store::model::StoreBatch;
use headroom_store::rollup::{DAY_MS, HOUR_MS, StorageConfig, bucket_start};
use headroom_store::views::AllocatorSeriesQuery;
use headroom_store::{SqliteStore, Store};
use headroom_tests::fixtures::now_ms;
use headroom_tests::postgres;

use super::{GIB, MIB, gpu_uuid, maintain_until_done, noise, percentile, register_request};

const REPORTING: u64 = 6;
const PID: u64 = 20_000;

/// What a training job's allocator reports at `second`: weights and
/// optimizer state that stay put, activations that rise and fall with each
/// step, the cache above them moving in 2 MiB blocks a few times an hour, a
/// retry now and then.
fn report(process: u64, second: i64) -> pb::AllocatorStats {
    let s = second as u64;
    let weights = (4 + process) * GIB;
    let activations = (s % 7) * 512 * MIB + noise(process, s, 11) % (64 * MIB);
    let allocated = 3 * weights + activations;
    let cache = (noise(process, s / 900, 12) % 2048) * 2 * MIB;
    let reserved = (allocated + cache).div_ceil(2 * MIB) * 2 * MIB;
    pb::AllocatorStats {
        timestamp_ms: second * 1000 + 250,
        allocated_bytes: allocated,
        reserved_bytes: reserved,
        active_bytes: allocated + noise(process, s, 13) % (16 * MIB),
        inactive_split_bytes: noise(process, s / 60, 14) % (256 * MIB),
        peak_allocated_bytes: 3 * weights + 6 * 512 * MIB + 64 * MIB,
        alloc_retries: s / 7200,
        ooms: 0,
        composition: s.is_multiple_of(10).then(|| pb::MemoryComposition {
            weights: Some(part(weights)),
            gradients: Some(part(weights)),
            optimizer_state: Some(part(weights)),
        }),
    }
}

fn part(bytes: u64) -> pb::CompositionPart {
    pb::CompositionPart {
        bytes,
        dtype: "bfloat16".into(),
    }
}

fn batch(seq: u64, second: i64) -> pb::Batch {
    let uuid = gpu_uuid(0, 0);
    let ts_ms = second * 1000;
    pb::Batch {
        node: register_request(0, "bench").node,
        boot_id: "bench".into(),
        seq,
        gpu_samples: vec![pb::GpuSample {
            uuid: uuid.clone(),
            timestamp_ms: ts_ms,
            interval_ms: 1000,
            poll_count: 10,
            memory_used_last_bytes: 60 * GIB,
            memory_used_min_bytes: 60 * GIB,
            memory_used_max_bytes: 60 * GIB,
            memory_total_bytes: 80 * GIB,
            ..pb::GpuSample::default()
        }],
        process_samples: (0..REPORTING)
            .map(|p| {
                let stats = report(p, second);
                pb::ProcessSample {
                    uuid: uuid.clone(),
                    timestamp_ms: ts_ms,
                    pid: (PID + p) as u32,
                    start_time_ms: 1_700_000_000_000,
                    name: "python train.py".into(),
                    uid: 1000,
                    user: "user0".into(),
                    memory_used_last_bytes: stats.reserved_bytes + 512 * MIB,
                    memory_used_max_bytes: stats.reserved_bytes + 512 * MIB,
                    allocator: Some(stats),
                    ..pb::ProcessSample::default()
                }
            })
            .collect(),
        events: vec![],
    }
}

/// Writes `[start_ms, end_ms)` through the store's write path, a minute of
/// batches a write, the open chunks written after each; returns the load's
/// seconds.
async fn load(store: &dyn Store, start_ms: i64, end_ms: i64) -> f64 {
    let limits = Limits::default();
    let session = store
        .register(
            &validate::registration(&register_request(0, "bench"), &limits).unwrap(),
            now_ms(),
        )
        .await
        .unwrap();
    let started = Instant::now();
    let mut group: Vec<StoreBatch> = Vec::with_capacity(60);
    let mut seq = 0;
    for second in start_ms / 1000..end_ms / 1000 {
        seq += 1;
        group.push(
            validate::batch(batch(seq, second), &session, second * 1000 + 1000, &limits).unwrap(),
        );
        if group.len() == 60 {
            store.write_batches(&group).await.unwrap();
            group.clear();
            store.flush(true).await.unwrap();
        }
    }
    store.write_batches(&group).await.unwrap();
    store.flush(true).await.unwrap();
    started.elapsed().as_secs_f64()
}

pub async fn allocator_charts_over_days(days: i64, rounds: usize) {
    let days = days.clamp(1, 7);
    println!(
        "## 9. Allocator charts: one GPU, {REPORTING} processes reporting every second for {days} days, 600 points"
    );
    // The loaded hours end an hour before the last whole hour, so that
    // every hour is closed and compacted whenever the bench runs, and start
    // an hour after the range's start, within raw retention; the charts end
    // where they end.
    let end_ms = bucket_start(now_ms(), HOUR_MS) - HOUR_MS;
    let start_ms = end_ms - days * DAY_MS + HOUR_MS;
    let db = postgres::fresh_database().await.expect("Postgres");
    let postgres = headroom_store::connect_with(&db.url, StorageConfig::default())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sqlite_url = format!("sqlite://{}", dir.path().join("allocator.db").display());
    let sqlite = SqliteStore::connect(&sqlite_url, StorageConfig::default())
        .await
        .unwrap();
    println!("| store | chart | six series at once, p50 / p99 | one series, p50 / p99 | points |");
    println!("|---|---|---|---|---|");
    let payload = "SELECT CAST(sum(length(data)) AS REAL) / sum(samples),
             CAST(COALESCE(sum(length(minutes)), 0) AS REAL) / sum(samples) FROM allocator_samples_packed";
    for (name, store) in [("Postgres", &*postgres), ("SQLite", &sqlite as &dyn Store)] {
        let load_s = load(store, start_ms, end_ms).await;
        let (maintain_s, compacted) = maintain_until_done(store).await;
        let (data, minutes): (f64, f64) = if name == "Postgres" {
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            sqlx::query_as(&payload.replace("REAL", "float8"))
                .fetch_one(&pool)
                .await
                .unwrap()
        } else {
            let pool = sqlx::SqlitePool::connect(&sqlite_url).await.unwrap();
            sqlx::query_as(payload).fetch_one(&pool).await.unwrap()
        };
        eprintln!(
            "{name}: loaded in {load_s:.1} s, maintained in {maintain_s:.1} s ({compacted} chunks compacted); \
             bytes per report: reports {data:.2}, minutes {minutes:.3}"
        );
        for (chart, span) in [
            ("1 h", HOUR_MS),
            ("24 h", DAY_MS),
            ("all days", days * DAY_MS),
        ] {
            time_chart(store, name, chart, (end_ms - span, end_ms - 1), rounds).await;
        }
    }
    drop(postgres);
    db.drop_database().await;
}

async fn time_chart(
    store: &dyn Store,
    name: &str,
    chart: &str,
    (from_ms, to_ms): (i64, i64),
    rounds: usize,
) {
    let uuid = gpu_uuid(0, 0);
    let query = |p: u64| AllocatorSeriesQuery {
        device_uuid: &uuid,
        pid: (PID + p) as i64,
        start_time_ms: None,
        from_ms,
        to_ms,
        max_points: 600,
    };
    let (mut together, mut alone, mut points) = (Vec::new(), Vec::new(), 0);
    for _ in 0..rounds {
        let started = Instant::now();
        let all = futures::future::join_all((0..REPORTING).map(|p| {
            let q = query(p);
            async move { store.allocator_series(&q).await.unwrap().unwrap() }
        }))
        .await;
        together.push(started.elapsed().as_secs_f64() * 1000.0);
        points = all[0].points.len();
        let started = Instant::now();
        store.allocator_series(&query(0)).await.unwrap().unwrap();
        alone.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    together.sort_by(f64::total_cmp);
    alone.sort_by(f64::total_cmp);
    println!(
        "| {name} | {chart} | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {points} |",
        percentile(&together, 0.5),
        percentile(&together, 0.99),
        percentile(&alone, 0.5),
        percentile(&alone, 0.99),
    );
}
