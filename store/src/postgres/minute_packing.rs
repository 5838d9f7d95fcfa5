//! Packing the minute rollups of closed hours. Minute rollups are kept for
//! months, so a row per series and minute was most of what a GPU costs on
//! disk in the long run. Once an hour's rollups are final, the compaction
//! pass moves them into one row per series and hour whose figures are
//! arrays of its minutes (`*_1m_packed`, see migration 0021); readers see
//! packed and loose minutes alike through `gpu_minutes()` and
//! `process_minutes()`.
//!
//! A minute is written loose and merged in place while its hour is open.
//! A late minute (a spool replayed after an outage) whose hour is packed
//! unpacks that series' hour first, so that its merge finds the minute it
//! belongs to, and the next pass packs the hour again. The two never race:
//! packing holds [`MINUTE_PACKING_LOCK`] exclusively, unpacking shares it.

use sqlx::postgres::PgPool;
use sqlx::{Postgres, Transaction};

use super::chunk_flush::{GPU_FIGURES_MERGED, MERGED_MEMORY};
use super::maintenance::MINUTE_PACKING_LOCK;
use crate::StoreError;
use crate::open_chunks::{GpuMinute, ProcessMinute};
use crate::rollup::{HOUR_MS, MINUTE_MS, bucket_start};

/// Packs the minute rollups of `hour` if they are final: the hour rolled up
/// and no minute or hour of it waiting to be rolled up again. Returns the
/// minute rows packed, or `None` where the hour is not final yet (the
/// caller marks it for a later pass).
pub(super) async fn pack_hour(pool: &PgPool, hour: i64) -> Result<Option<u64>, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MINUTE_PACKING_LOCK)
        .execute(&mut *tx)
        .await?;
    let is_final: bool = sqlx::query_scalar(
        "SELECT COALESCE((SELECT done_until_ms FROM rollup_progress WHERE step_ms = $2), 0) >= $1 + $2
             AND NOT EXISTS (SELECT 1 FROM rollup_pending
                 WHERE (step_ms = $2 AND bucket_ms = $1)
                     OR (step_ms = $3 AND bucket_ms >= $1 AND bucket_ms < $1 + $2))",
    )
    .bind(hour)
    .bind(HOUR_MS)
    .bind(MINUTE_MS)
    .fetch_one(&mut *tx)
    .await?;
    if !is_final {
        return Ok(None);
    }
    // A series' hour packed and loose at once (minutes merged by a
    // collector older than packing, during a rolling upgrade) is unpacked
    // first, its minutes merged with the loose ones, then packed whole.
    // (A statement in WITH runs in full whether or not the query reads it.)
    sqlx::query(&format!(
        "WITH gone AS (
             DELETE FROM gpu_samples_1m_packed p WHERE p.hour_ms = $1 AND EXISTS (
                 SELECT 1 FROM gpu_samples_1m r
                 WHERE r.device_id = p.device_id AND r.ts_ms >= $1 AND r.ts_ms < $1 + $2)
             RETURNING p.*)
         {}",
        gpu_unpacked()
    ))
    .bind(hour)
    .bind(HOUR_MS)
    .execute(&mut *tx)
    .await?;
    sqlx::query(&format!(
        "WITH gone AS (
             DELETE FROM process_samples_1m_packed p WHERE p.hour_ms = $1 AND EXISTS (
                 SELECT 1 FROM process_samples_1m r
                 WHERE r.process_id = p.process_id AND r.ts_ms >= $1 AND r.ts_ms < $1 + $2)
             RETURNING p.*)
         {}",
        process_unpacked()
    ))
    .bind(hour)
    .bind(HOUR_MS)
    .execute(&mut *tx)
    .await?;
    let gpu: i64 = sqlx::query_scalar(
        "WITH gone AS (
             DELETE FROM gpu_samples_1m WHERE ts_ms >= $1 AND ts_ms < $1 + $2 RETURNING *),
         packed AS (
             INSERT INTO gpu_samples_1m_packed (hour_ms, device_id, minute, last_offset_ms, samples,
                 used_min, used_max, used_avg, used_last, reserved, total, utilization, pcie_tx, pcie_rx)
             SELECT $1, device_id, array_agg(((ts_ms - $1) / $3)::int2 ORDER BY ts_ms),
                 array_agg((last_ts_ms - ts_ms)::int4 ORDER BY ts_ms), array_agg(samples ORDER BY ts_ms),
                 array_agg(used_min ORDER BY ts_ms), array_agg(used_max ORDER BY ts_ms),
                 array_agg(used_avg ORDER BY ts_ms), array_agg(used_last ORDER BY ts_ms),
                 array_agg(reserved ORDER BY ts_ms), array_agg(total ORDER BY ts_ms),
                 array_agg(utilization ORDER BY ts_ms), array_agg(pcie_tx ORDER BY ts_ms),
                 array_agg(pcie_rx ORDER BY ts_ms)
             FROM gone GROUP BY device_id)
         SELECT count(*) FROM gone",
    )
    .bind(hour)
    .bind(HOUR_MS)
    .bind(MINUTE_MS)
    .fetch_one(&mut *tx)
    .await?;
    let process: i64 = sqlx::query_scalar(
        "WITH gone AS (
             DELETE FROM process_samples_1m WHERE ts_ms >= $1 AND ts_ms < $1 + $2 RETURNING *),
         packed AS (
             INSERT INTO process_samples_1m_packed (hour_ms, process_id, minute, last_offset_ms, samples,
                 used_min, used_max, used_avg, used_last)
             SELECT $1, process_id, array_agg(((ts_ms - $1) / $3)::int2 ORDER BY ts_ms),
                 array_agg((last_ts_ms - ts_ms)::int4 ORDER BY ts_ms), array_agg(samples ORDER BY ts_ms),
                 array_agg(used_min ORDER BY ts_ms), array_agg(used_max ORDER BY ts_ms),
                 array_agg(used_avg ORDER BY ts_ms), array_agg(used_last ORDER BY ts_ms)
             FROM gone GROUP BY process_id)
         SELECT count(*) FROM gone",
    )
    .bind(hour)
    .bind(HOUR_MS)
    .bind(MINUTE_MS)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(u64::try_from(gpu + process).unwrap_or(0)))
}

/// Before a flush merges minutes older than the minute watermark
/// `done_until`: unpacks the hours of those series that were packed. Newer
/// minutes need nothing: an hour is packed only once the hour watermark,
/// which trails the minute watermark, passed it, and the flush holds the
/// minute watermark where it is until it commits.
pub(super) async fn unpack_for_late_minutes(
    tx: &mut Transaction<'_, Postgres>,
    gpu_minutes: &[GpuMinute],
    process_minutes: &[ProcessMinute],
    done_until: i64,
) -> Result<(), StoreError> {
    let gpu = late_series_hours(
        gpu_minutes.iter().map(|m| (m.device_id, m.minute_ms)),
        done_until,
    );
    let process = late_series_hours(
        process_minutes.iter().map(|m| (m.process_id, m.minute_ms)),
        done_until,
    );
    if gpu.is_empty() && process.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
        .bind(MINUTE_PACKING_LOCK)
        .execute(&mut **tx)
        .await?;
    if !gpu.is_empty() {
        let devices = gpu
            .iter()
            .map(|(device_id, _)| {
                i32::try_from(*device_id).map_err(|_| {
                    StoreError::Invalid(format!("device id {device_id} is out of range"))
                })
            })
            .collect::<Result<Vec<i32>, StoreError>>()?;
        let hours: Vec<i64> = gpu.iter().map(|(_, hour)| *hour).collect();
        sqlx::query(&format!(
            "WITH gone AS (
                 DELETE FROM gpu_samples_1m_packed p
                 USING UNNEST($1::int4[], $2::int8[]) AS v(device_id, hour_ms)
                 WHERE p.device_id = v.device_id AND p.hour_ms = v.hour_ms
                 RETURNING p.*)
             {}",
            gpu_unpacked()
        ))
        .bind(devices)
        .bind(hours)
        .execute(&mut **tx)
        .await?;
    }
    if !process.is_empty() {
        let processes: Vec<i64> = process.iter().map(|(id, _)| *id).collect();
        let hours: Vec<i64> = process.iter().map(|(_, hour)| *hour).collect();
        sqlx::query(&format!(
            "WITH gone AS (
                 DELETE FROM process_samples_1m_packed p
                 USING UNNEST($1::int8[], $2::int8[]) AS v(process_id, hour_ms)
                 WHERE p.process_id = v.process_id AND p.hour_ms = v.hour_ms
                 RETURNING p.*)
             {}",
            process_unpacked()
        ))
        .bind(processes)
        .bind(hours)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// Before minutes of `[from, to)` are rolled up again from raw rows (what a
/// collector writing rows during a rolling upgrade leaves): unpacks the
/// hours of the devices and processes that have raw rows there.
pub(super) async fn unpack_for_raw_rollup(
    tx: &mut Transaction<'_, Postgres>,
    from: i64,
    to: i64,
) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
        .bind(MINUTE_PACKING_LOCK)
        .execute(&mut **tx)
        .await?;
    sqlx::query(&format!(
        "WITH gone AS (
             DELETE FROM gpu_samples_1m_packed p
             WHERE p.hour_ms >= $1 AND p.hour_ms < $2
                 AND p.device_id IN (SELECT DISTINCT device_id FROM gpu_samples WHERE ts_ms >= $3 AND ts_ms < $2)
             RETURNING p.*)
         {}",
            gpu_unpacked()
    ))
    .bind(bucket_start(from, HOUR_MS))
    .bind(to)
    .bind(from)
    .execute(&mut **tx)
    .await?;
    sqlx::query(&format!(
        "WITH gone AS (
             DELETE FROM process_samples_1m_packed p
             WHERE p.hour_ms >= $1 AND p.hour_ms < $2
                 AND p.process_id IN (SELECT DISTINCT process_id FROM process_samples WHERE ts_ms >= $3 AND ts_ms < $2)
             RETURNING p.*)
         {}",
            process_unpacked()
    ))
    .bind(bucket_start(from, HOUR_MS))
    .bind(to)
    .bind(from)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The distinct `(series, hour)` of the minutes before `done_until`.
fn late_series_hours(
    minutes: impl Iterator<Item = (i64, i64)>,
    done_until: i64,
) -> Vec<(i64, i64)> {
    let mut late: Vec<(i64, i64)> = minutes
        .filter(|(_, minute)| *minute < done_until)
        .map(|(series, minute)| (series, bucket_start(minute, HOUR_MS)))
        .collect();
    late.sort_unstable();
    late.dedup();
    late
}

/// The minutes of the packed rows in `gone`, back as loose rows, merged
/// with any loose row of the same minute.
const GPU_UNPACKED: &str = "INSERT INTO gpu_samples_1m AS r (device_id, ts_ms, last_ts_ms, samples,
        used_min, used_max, used_avg, used_last, reserved, total, utilization, pcie_tx, pcie_rx)
    SELECT g.device_id, g.hour_ms + m.minute * 60000, g.hour_ms + m.minute * 60000 + m.last_offset_ms,
        m.samples, m.used_min, m.used_max, m.used_avg, m.used_last, m.reserved, m.total,
        m.utilization, m.pcie_tx, m.pcie_rx
    FROM gone g,
        LATERAL unnest(g.minute, g.last_offset_ms, g.samples, g.used_min, g.used_max, g.used_avg,
            g.used_last, g.reserved, g.total, g.utilization, g.pcie_tx, g.pcie_rx)
            AS m(minute, last_offset_ms, samples, used_min, used_max, used_avg, used_last, reserved,
                 total, utilization, pcie_tx, pcie_rx)
    ON CONFLICT (device_id, ts_ms) DO UPDATE SET";

fn gpu_unpacked() -> String {
    format!("{GPU_UNPACKED} {MERGED_MEMORY}, {GPU_FIGURES_MERGED}")
}

const PROCESS_UNPACKED: &str = "INSERT INTO process_samples_1m AS r (process_id, ts_ms, last_ts_ms,
        samples, used_min, used_max, used_avg, used_last)
    SELECT g.process_id, g.hour_ms + m.minute * 60000, g.hour_ms + m.minute * 60000 + m.last_offset_ms,
        m.samples, m.used_min, m.used_max, m.used_avg, m.used_last
    FROM gone g,
        LATERAL unnest(g.minute, g.last_offset_ms, g.samples, g.used_min, g.used_max, g.used_avg,
            g.used_last)
            AS m(minute, last_offset_ms, samples, used_min, used_max, used_avg, used_last)
    ON CONFLICT (process_id, ts_ms) DO UPDATE SET";

fn process_unpacked() -> String {
    format!("{PROCESS_UNPACKED} {MERGED_MEMORY}")
}
