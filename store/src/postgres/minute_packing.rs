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
use crate::flush_encoding::Encoded;
use crate::rollup::{HOUR_MS, MINUTE_MS, bucket_start};

/// One kind of series' minute rollups: where they sit loose and packed,
/// where its raw rows sit, and the figures a minute holds beyond its time
/// and sample count.
struct MinuteTables {
    loose: &'static str,
    packed: &'static str,
    raw: &'static str,
    key: &'static str,
    figures: &'static [&'static str],
    /// How the figures beyond the memory ones merge, where there are any.
    more_merged: Option<&'static str>,
}

const GPU: MinuteTables = MinuteTables {
    loose: "gpu_samples_1m",
    packed: "gpu_samples_1m_packed",
    raw: "gpu_samples",
    key: "device_id",
    figures: &[
        "used_min",
        "used_max",
        "used_avg",
        "used_last",
        "reserved",
        "total",
        "utilization",
        "pcie_tx",
        "pcie_rx",
    ],
    more_merged: Some(GPU_FIGURES_MERGED),
};

const PROCESS: MinuteTables = MinuteTables {
    loose: "process_samples_1m",
    packed: "process_samples_1m_packed",
    raw: "process_samples",
    key: "process_id",
    figures: &["used_min", "used_max", "used_avg", "used_last"],
    more_merged: None,
};

impl MinuteTables {
    /// Deletes the packed rows that `packed_rows` (a `WHERE` clause over
    /// `p`) picks and puts their minutes back as loose rows, each merged
    /// with any loose row of the same minute.
    fn unpack_sql(&self, packed_rows: &str) -> String {
        let Self {
            loose, packed, key, ..
        } = self;
        let figures = self.figures.join(", ");
        let of = |table: &str| {
            self.figures
                .iter()
                .map(|f| format!("{table}.{f}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (of_minute, of_gone) = (of("m"), of("g"));
        let merged = match self.more_merged {
            Some(more) => format!("{MERGED_MEMORY}, {more}"),
            None => MERGED_MEMORY.to_string(),
        };
        format!(
            "WITH gone AS (DELETE FROM {packed} p {packed_rows} RETURNING p.*)
             INSERT INTO {loose} AS r ({key}, ts_ms, last_ts_ms, samples, {figures})
             SELECT g.{key}, g.hour_ms + m.minute * 60000,
                 g.hour_ms + m.minute * 60000 + m.last_offset_ms, m.samples, {of_minute}
             FROM gone g,
                 LATERAL unnest(g.minute, g.last_offset_ms, g.samples, {of_gone})
                     AS m(minute, last_offset_ms, samples, {figures})
             ON CONFLICT ({key}, ts_ms) DO UPDATE SET {merged}"
        )
    }

    /// Moves the loose minutes of the hour `$1` (`$2` an hour, `$3` a
    /// minute) of the series `$4` into a packed row per series; returns the
    /// rows moved. (A statement in WITH runs in full whether or not the
    /// query reads it.)
    fn pack_sql(&self) -> String {
        let Self {
            loose, packed, key, ..
        } = self;
        let figures = self.figures.join(", ");
        let arrays = self
            .figures
            .iter()
            .map(|f| format!("array_agg({f} ORDER BY ts_ms)"))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "WITH gone AS (
                 DELETE FROM {loose} WHERE {key} = ANY($4::int8[]) AND ts_ms >= $1 AND ts_ms < $1 + $2
                 RETURNING *),
             packed AS (
                 INSERT INTO {packed} (hour_ms, {key}, minute, last_offset_ms, samples, {figures})
                 SELECT $1, {key}, array_agg(((ts_ms - $1) / $3)::int2 ORDER BY ts_ms),
                     array_agg((last_ts_ms - ts_ms)::int4 ORDER BY ts_ms),
                     array_agg(samples ORDER BY ts_ms), {arrays}
                 FROM gone GROUP BY {key})
             SELECT count(*) FROM gone"
        )
    }
}

/// Series packed per transaction. At 100,000 GPUs an hour holds 6 million
/// GPU and 12 million process minute rows: in one transaction, late
/// minutes of that hour would wait minutes for it, and the WAL would come
/// in one burst.
const SERIES_PER_TRANSACTION: usize = 2_000;

/// Packs the minute rollups of `hour` if they are final: the hour rolled up
/// and no minute or hour of it waiting to be rolled up again. Returns the
/// minute rows packed, or `None` where the hour is not final yet (the
/// caller marks it for a later pass, which packs the series still loose).
pub(super) async fn pack_hour(pool: &PgPool, hour: i64) -> Result<Option<u64>, StoreError> {
    let mut moved = 0;
    for tables in [&GPU, &PROCESS] {
        let MinuteTables { loose, key, .. } = tables;
        let series: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT DISTINCT {key}::int8 FROM {loose} WHERE ts_ms >= $1 AND ts_ms < $1 + $2 ORDER BY 1"
        ))
        .bind(hour)
        .bind(HOUR_MS)
        .fetch_all(pool)
        .await?;
        for batch in series.chunks(SERIES_PER_TRANSACTION) {
            match pack_series(pool, tables, hour, batch).await? {
                Some(rows) => moved += rows,
                None => return Ok(None),
            }
        }
    }
    Ok(Some(moved))
}

/// Packs the minutes of `hour` of `series` in one transaction, if the
/// hour is final.
async fn pack_series(
    pool: &PgPool,
    tables: &MinuteTables,
    hour: i64,
    series: &[i64],
) -> Result<Option<u64>, StoreError> {
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
    let MinuteTables { loose, key, .. } = tables;
    sqlx::query(&tables.unpack_sql(&format!(
        "WHERE p.hour_ms = $1 AND p.{key} = ANY($3::int8[]) AND EXISTS (SELECT 1 FROM {loose} r
             WHERE r.{key} = p.{key} AND r.ts_ms >= $1 AND r.ts_ms < $1 + $2)"
    )))
    .bind(hour)
    .bind(HOUR_MS)
    .bind(series)
    .execute(&mut *tx)
    .await?;
    let rows: i64 = sqlx::query_scalar(&tables.pack_sql())
        .bind(hour)
        .bind(HOUR_MS)
        .bind(MINUTE_MS)
        .bind(series)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(u64::try_from(rows).unwrap_or(0)))
}

/// Before a flush merges minutes older than the minute watermark
/// `done_until`: unpacks the hours of those series that were packed. Newer
/// minutes need nothing: an hour is packed only once the hour watermark,
/// which trails the minute watermark, passed it, and the flush holds the
/// minute watermark where it is until it commits.
pub(super) async fn unpack_for_late_minutes(
    tx: &mut Transaction<'_, Postgres>,
    encoded: &Encoded,
    done_until: i64,
) -> Result<(), StoreError> {
    let (gpu, process) = encoded.late_series_hours(done_until);
    let late = [(&GPU, gpu), (&PROCESS, process)];
    if late.iter().all(|(_, series_hours)| series_hours.is_empty()) {
        return Ok(());
    }
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
        .bind(MINUTE_PACKING_LOCK)
        .execute(&mut **tx)
        .await?;
    for (tables, series_hours) in late {
        if series_hours.is_empty() {
            continue;
        }
        let key = tables.key;
        let (series, hours): (Vec<i64>, Vec<i64>) = series_hours.into_iter().unzip();
        sqlx::query(&tables.unpack_sql(&format!(
            "USING UNNEST($1::int8[], $2::int8[]) AS v(series, hour_ms)
             WHERE p.{key} = v.series AND p.hour_ms = v.hour_ms"
        )))
        .bind(series)
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
    for tables in [&GPU, &PROCESS] {
        let MinuteTables { raw, key, .. } = tables;
        sqlx::query(&tables.unpack_sql(&format!(
            "WHERE p.hour_ms >= $1 AND p.hour_ms < $2
                 AND p.{key} IN (SELECT DISTINCT {key} FROM {raw} WHERE ts_ms >= $3 AND ts_ms < $2)"
        )))
        .bind(bucket_start(from, HOUR_MS))
        .bind(to)
        .bind(from)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}
