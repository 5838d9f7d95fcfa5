//! Rollups and retention on SQLite: the same passes as Postgres
//! (store/postgres/maintenance.rs) with the same tables and watermarks. One
//! process owns an SQLite file, so it always leads; without partitions,
//! retention deletes by time range on the `ts_ms` indexes.

use sqlx::sqlite::{SqliteConnection, SqlitePool};
use sqlx::{Sqlite, Transaction};

use crate::StoreError;
use crate::rollup::{
    HOUR_MS, MINUTE_MS, MaintenanceReport, StorageConfig, Watermarks, bucket_start,
    contiguous_runs, next_minute_watermark,
};
use crate::views::LOW_HEADROOM_USED_TENTHS;

/// Buckets rolled up per transaction, so writers wait at most one short one.
const BUCKETS_PER_PASS: i64 = 360;

pub(super) async fn watermarks(pool: &SqlitePool) -> Result<Watermarks, StoreError> {
    Ok(sqlx::query_as::<_, Watermarks>(
        "SELECT COALESCE((SELECT done_until_ms FROM rollup_progress WHERE step_ms = ?1), 0) AS minute_ms,
                COALESCE((SELECT done_until_ms FROM rollup_progress WHERE step_ms = ?2), 0) AS hour_ms",
    )
    .bind(MINUTE_MS)
    .bind(HOUR_MS)
    .fetch_one(pool)
    .await?)
}

pub(super) async fn run(
    pool: &SqlitePool,
    storage: &StorageConfig,
    now_ms: i64,
) -> Result<MaintenanceReport, StoreError> {
    let mut report = MaintenanceReport {
        leader: true,
        ..MaintenanceReport::default()
    };
    advance_minutes(pool, now_ms).await?;
    report.minutes_rolled_up = roll_up(pool, MINUTE_MS).await?;
    report.hours_rolled_up = roll_up(pool, HOUR_MS).await?;
    sqlx::query(
        "UPDATE rollup_progress SET done_until_ms = MAX(done_until_ms,
             (SELECT done_until_ms - done_until_ms % ?2 FROM rollup_progress WHERE step_ms = ?1))
         WHERE step_ms = ?2",
    )
    .bind(MINUTE_MS)
    .bind(HOUR_MS)
    .execute(pool)
    .await?;
    report.chunks_compacted = super::chunks::compact_closed_hours(
        pool,
        now_ms,
        std::time::Instant::now() + storage.pack_time_per_pass(),
    )
    .await?;
    let marks = watermarks(pool).await?;
    report.rows_expired = expire(pool, storage, now_ms, marks).await?;
    report.watermarks = Some(marks);
    Ok(report)
}

async fn advance_minutes(pool: &SqlitePool, now_ms: i64) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    let Some(done): Option<i64> =
        sqlx::query_scalar("SELECT done_until_ms FROM rollup_progress WHERE step_ms = ?1")
            .bind(MINUTE_MS)
            .fetch_optional(&mut *tx)
            .await?
    else {
        return Ok(());
    };
    let Some(target) = next_minute_watermark(done, now_ms) else {
        return Ok(());
    };
    sqlx::query("UPDATE rollup_progress SET done_until_ms = ?2 WHERE step_ms = ?1")
        .bind(MINUTE_MS)
        .bind(target)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "WITH RECURSIVE m(bucket) AS (SELECT ?2 UNION ALL SELECT bucket + ?1 FROM m WHERE bucket + ?1 < ?3)
         INSERT INTO rollup_pending (step_ms, bucket_ms) SELECT ?1, bucket FROM m WHERE true
         ON CONFLICT DO NOTHING",
    )
    .bind(MINUTE_MS)
    .bind(done)
    .bind(target)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Rolls up pending buckets of `step_ms` (minutes from raw samples, hours
/// from minutes), a pass's worth per transaction; a rolled-up minute marks
/// its hour pending. An hour is rolled up once the minute watermark has
/// passed its end: nothing reads the running hour from the hour table
/// (charts read it from its minutes), so redoing it each pass was wasted.
async fn roll_up(pool: &SqlitePool, step_ms: i64) -> Result<u64, StoreError> {
    let ended_by = if step_ms == HOUR_MS {
        watermarks(pool).await?.minute_ms
    } else {
        i64::MAX
    };
    let mut total = 0;
    loop {
        let mut tx = pool.begin().await?;
        let buckets: Vec<i64> = sqlx::query_scalar(
            "DELETE FROM rollup_pending WHERE step_ms = ?1 AND bucket_ms IN (
                 SELECT bucket_ms FROM rollup_pending WHERE step_ms = ?1 AND bucket_ms <= ?3 - ?1
                 ORDER BY bucket_ms LIMIT ?2)
             RETURNING bucket_ms",
        )
        .bind(step_ms)
        .bind(BUCKETS_PER_PASS)
        .bind(ended_by)
        .fetch_all(&mut *tx)
        .await?;
        if buckets.is_empty() {
            tx.commit().await?;
            return Ok(total);
        }
        for (from, to) in contiguous_runs(&buckets, step_ms) {
            if step_ms == MINUTE_MS {
                minutes_from_raw(&mut tx, from, to).await?;
            } else {
                hours_from_minutes(&mut tx, from, to).await?;
            }
            roll_up_fleet(&mut tx, step_ms, from, to).await?;
        }
        if step_ms == MINUTE_MS {
            let mut hours: Vec<i64> = buckets.iter().map(|m| bucket_start(*m, HOUR_MS)).collect();
            hours.sort_unstable();
            hours.dedup();
            for hour in hours {
                sqlx::query(
                    "INSERT INTO rollup_pending (step_ms, bucket_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                )
                .bind(HOUR_MS)
                .bind(hour)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        total += buckets.len() as u64;
    }
}

const GPU_UPDATE: &str = "ON CONFLICT (device_id, ts_ms) DO UPDATE SET last_ts_ms = excluded.last_ts_ms,
    samples = excluded.samples, used_min = excluded.used_min, used_max = excluded.used_max,
    used_avg = excluded.used_avg, used_last = excluded.used_last, reserved = excluded.reserved,
    total = excluded.total, utilization = excluded.utilization, pcie_tx = excluded.pcie_tx, pcie_rx = excluded.pcie_rx";
const PROCESS_UPDATE: &str =
    "ON CONFLICT (process_id, ts_ms) DO UPDATE SET last_ts_ms = excluded.last_ts_ms,
    samples = excluded.samples, used_min = excluded.used_min, used_max = excluded.used_max,
    used_avg = excluded.used_avg, used_last = excluded.used_last";

/// "Last" is the value of the row at the bucket's newest timestamp, joined
/// back on the (device, ts) index.
async fn minutes_from_raw(
    tx: &mut Transaction<'_, Sqlite>,
    from: i64,
    to: i64,
) -> Result<(), StoreError> {
    sqlx::query(&format!(
        "INSERT INTO gpu_samples_1m (device_id, ts_ms, last_ts_ms, samples, used_min, used_max, used_avg, used_last,
             reserved, total, utilization, pcie_tx, pcie_rx)
         SELECT a.device_id, a.bucket, a.last_ts, a.n, a.mn, a.mx, a.av, MAX(s.used_last), a.res, a.tot, a.util, a.tx, a.rx
         FROM (SELECT device_id, ts_ms - ts_ms % ?3 AS bucket, MAX(ts_ms) AS last_ts, COUNT(*) AS n,
                   MIN(used_min) AS mn, MAX(used_max) AS mx, CAST(ROUND(AVG(used_last)) AS INTEGER) AS av,
                   MAX(reserved) AS res, MAX(total) AS tot, AVG(utilization) AS util,
                   CAST(ROUND(AVG(pcie_tx)) AS INTEGER) AS tx, CAST(ROUND(AVG(pcie_rx)) AS INTEGER) AS rx
               FROM gpu_samples WHERE ts_ms >= ?1 AND ts_ms < ?2 GROUP BY device_id, bucket) a
         JOIN gpu_samples s ON s.device_id = a.device_id AND s.ts_ms = a.last_ts
         WHERE true GROUP BY a.device_id, a.bucket
         {GPU_UPDATE}"
    ))
    .bind(from)
    .bind(to)
    .bind(MINUTE_MS)
    .execute(&mut **tx)
    .await?;
    sqlx::query(&format!(
        "INSERT INTO process_samples_1m (process_id, ts_ms, last_ts_ms, samples, used_min, used_max, used_avg, used_last)
         SELECT a.process_id, a.bucket, a.last_ts, a.n, a.mn, a.mx, a.av, MAX(s.used_last)
         FROM (SELECT process_id, ts_ms - ts_ms % ?3 AS bucket, MAX(ts_ms) AS last_ts, COUNT(*) AS n,
                   MIN(used_last) AS mn, MAX(used_max) AS mx, CAST(ROUND(AVG(used_last)) AS INTEGER) AS av
               FROM process_samples WHERE ts_ms >= ?1 AND ts_ms < ?2 GROUP BY process_id, bucket) a
         JOIN process_samples s ON s.process_id = a.process_id AND s.ts_ms = a.last_ts
         WHERE true GROUP BY a.process_id, a.bucket
         {PROCESS_UPDATE}"
    ))
    .bind(from)
    .bind(to)
    .bind(MINUTE_MS)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Averages of averages, weighted by how many samples each minute holds.
async fn hours_from_minutes(
    tx: &mut Transaction<'_, Sqlite>,
    from: i64,
    to: i64,
) -> Result<(), StoreError> {
    sqlx::query(&format!(
        "INSERT INTO gpu_samples_1h (device_id, ts_ms, last_ts_ms, samples, used_min, used_max, used_avg, used_last,
             reserved, total, utilization, pcie_tx, pcie_rx)
         SELECT a.device_id, a.bucket, a.last_ts, a.n, a.mn, a.mx, a.av, MAX(s.used_last), a.res, a.tot, a.util, a.tx, a.rx
         FROM (SELECT device_id, ts_ms - ts_ms % ?3 AS bucket, MAX(last_ts_ms) AS last_ts, SUM(samples) AS n,
                   MIN(used_min) AS mn, MAX(used_max) AS mx,
                   CAST(ROUND(SUM(CAST(used_avg AS REAL) * samples) / SUM(samples)) AS INTEGER) AS av,
                   MAX(reserved) AS res, MAX(total) AS tot,
                   SUM(utilization * samples) / NULLIF(SUM(samples) FILTER (WHERE utilization IS NOT NULL), 0) AS util,
                   CAST(ROUND(SUM(CAST(pcie_tx AS REAL) * samples)
                       / NULLIF(SUM(samples) FILTER (WHERE pcie_tx IS NOT NULL), 0)) AS INTEGER) AS tx,
                   CAST(ROUND(SUM(CAST(pcie_rx AS REAL) * samples)
                       / NULLIF(SUM(samples) FILTER (WHERE pcie_rx IS NOT NULL), 0)) AS INTEGER) AS rx
               FROM gpu_samples_1m WHERE ts_ms >= ?1 AND ts_ms < ?2 GROUP BY device_id, bucket) a
         JOIN gpu_samples_1m s ON s.device_id = a.device_id AND s.last_ts_ms = a.last_ts
             AND s.ts_ms >= ?1 AND s.ts_ms < ?2
         WHERE true GROUP BY a.device_id, a.bucket
         {GPU_UPDATE}"
    ))
    .bind(from)
    .bind(to)
    .bind(HOUR_MS)
    .execute(&mut **tx)
    .await?;
    sqlx::query(&format!(
        "INSERT INTO process_samples_1h (process_id, ts_ms, last_ts_ms, samples, used_min, used_max, used_avg, used_last)
         SELECT a.process_id, a.bucket, a.last_ts, a.n, a.mn, a.mx, a.av, MAX(s.used_last)
         FROM (SELECT process_id, ts_ms - ts_ms % ?3 AS bucket, MAX(last_ts_ms) AS last_ts, SUM(samples) AS n,
                   MIN(used_min) AS mn, MAX(used_max) AS mx,
                   CAST(ROUND(SUM(CAST(used_avg AS REAL) * samples) / SUM(samples)) AS INTEGER) AS av
               FROM process_samples_1m WHERE ts_ms >= ?1 AND ts_ms < ?2 GROUP BY process_id, bucket) a
         JOIN process_samples_1m s ON s.process_id = a.process_id AND s.last_ts_ms = a.last_ts
             AND s.ts_ms >= ?1 AND s.ts_ms < ?2
         WHERE true GROUP BY a.process_id, a.bucket
         {PROCESS_UPDATE}"
    ))
    .bind(from)
    .bind(to)
    .bind(HOUR_MS)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Recomputes the fleet's row of every bucket of `step_ms` in `[from, to)`
/// from all the devices' rollup rows of that bucket, in the transaction that
/// wrote them (see the Postgres twin in store/postgres/maintenance.rs).
pub(super) async fn roll_up_fleet(
    conn: &mut SqliteConnection,
    step_ms: i64,
    from: i64,
    to: i64,
) -> Result<(), StoreError> {
    let (source, target) = if step_ms == HOUR_MS {
        ("gpu_samples_1h", "fleet_1h")
    } else {
        ("gpu_samples_1m", "fleet_1m")
    };
    sqlx::query(&format!(
        "INSERT INTO {target} (ts_ms, used_avg, used_max, capacity, devices, devices_below_10pct)
         SELECT r.ts_ms,
             COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.used_avg END), 0),
             COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.used_max END), 0),
             COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.total END), 0),
             COUNT(CASE WHEN d.parent_id IS NULL THEN 1 END),
             COUNT(DISTINCT CASE WHEN r.total > 0 AND (r.used_max + r.reserved) * 10 >= r.total * ?3
                 THEN COALESCE(d.parent_id, d.id) END)
         FROM {source} r JOIN devices d ON d.id = r.device_id
         WHERE r.ts_ms >= ?1 AND r.ts_ms < ?2
         GROUP BY r.ts_ms
         ON CONFLICT (ts_ms) DO UPDATE SET used_avg = excluded.used_avg, used_max = excluded.used_max,
             capacity = excluded.capacity, devices = excluded.devices,
             devices_below_10pct = excluded.devices_below_10pct"
    ))
    .bind(from)
    .bind(to)
    .bind(LOW_HEADROOM_USED_TENTHS)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Deletes what each table no longer keeps, once the next rollup has it.
async fn expire(
    pool: &SqlitePool,
    storage: &StorageConfig,
    now_ms: i64,
    marks: Watermarks,
) -> Result<u64, StoreError> {
    let raw_cutoff = (now_ms - storage.raw_retention_ms()).min(marks.minute_ms);
    let minute_cutoff = (now_ms - storage.minute_retention_ms()).min(marks.hour_ms);
    let hour_cutoff = now_ms - storage.hour_retention_ms();
    let tables = [
        ("gpu_samples", raw_cutoff),
        ("process_samples", raw_cutoff),
        ("allocator_samples", raw_cutoff),
        ("events", now_ms - storage.minute_retention_ms()),
        ("gpu_samples_1m", minute_cutoff),
        ("process_samples_1m", minute_cutoff),
        ("gpu_samples_1h", hour_cutoff),
        ("fleet_1m", minute_cutoff),
        ("fleet_1h", hour_cutoff),
        ("process_samples_1h", hour_cutoff),
    ];
    let mut expired = 0;
    for (table, cutoff) in tables {
        expired += sqlx::query(&format!("DELETE FROM {table} WHERE ts_ms < ?1"))
            .bind(cutoff)
            .execute(pool)
            .await?
            .rows_affected();
    }
    // A chunk goes once its newest sample is past raw retention.
    for table in [
        "gpu_samples_packed",
        "process_samples_packed",
        "allocator_samples_packed",
    ] {
        expired += sqlx::query(&format!(
            "DELETE FROM {table} WHERE hour_ms < ?1 AND last_ts_ms < ?1"
        ))
        .bind(raw_cutoff)
        .execute(pool)
        .await?
        .rows_affected();
    }
    sqlx::query("DELETE FROM compact_pending WHERE hour_ms < ?1 - ?2")
        .bind(raw_cutoff)
        .bind(HOUR_MS)
        .execute(pool)
        .await?;
    Ok(expired)
}
