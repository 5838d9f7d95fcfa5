//! Packing the rollups of closed spans. Minute rollups are kept for months
//! and hour rollups for years, so a row per series and bucket was most of
//! what a GPU costs on disk in the long run. Once a span's rollups are
//! final, maintenance moves them into one row per series and span whose
//! figures are arrays of its buckets: an hour's minutes (`*_1m_packed`,
//! migration 0021, by the compaction pass) and a day's hours
//! (`*_1h_packed`, migration 0024). Readers see packed and loose rollups
//! alike through `gpu_minutes()`, `process_minutes()`, `gpu_hours()` and
//! `process_hours()`.
//!
//! A bucket is written loose, and merged or redone in place while its span
//! is open. A late minute (a spool replayed after an outage) whose hour is
//! packed unpacks that series' hour first, so that its merge finds the
//! minute it belongs to. An hour rolled up again inside a packed day (for
//! the series a late flush marked, or for the whole fleet) is written loose
//! beside its packed copy, which readers then skip (migration 0025), rather
//! than unpacking the day (24 rows written a series). The next pass packs
//! the span again, folding loose hours into the day's row. The two never
//! race: packing holds the span's lock exclusively, writers of late buckets
//! share it.

use std::time::Instant;

use sqlx::postgres::PgPool;
use sqlx::{Postgres, Transaction};

use super::chunk_flush::{GPU_FIGURES_MERGED, MERGED_MEMORY};
use super::maintenance::{HOUR_PACKING_LOCK, MINUTE_PACKING_LOCK, ensure_partitions_of};
use crate::StoreError;
use crate::flush_encoding::SeriesHours;
use crate::rollup::{DAY_MS, HOUR_MS, MINUTE_MS, bucket_start};

/// One resolution of one kind of series' rollups: where they sit loose and
/// packed, and the figures a bucket holds beyond its time and sample count.
struct PackedRollups {
    loose: &'static str,
    packed: &'static str,
    key: &'static str,
    figures: &'static [&'static str],
    /// The packed row's span column (its start) and the column of each
    /// bucket's place in the span.
    span_column: &'static str,
    slot_column: &'static str,
    step_ms: i64,
    /// How a packed bucket and a loose one of the same time become one.
    on_conflict: OnConflict,
}

enum OnConflict {
    /// Minutes are merged: the loose one holds samples the packed one does
    /// not (a late one, or one merged by a collector older than packing).
    /// The figures beyond the memory ones merge as given, where there are
    /// any.
    Merge(Option<&'static str>),
    /// The loose hour wins: an hour is always redone whole, from every
    /// minute, so a loose one is newer than its packed copy. Packing folds
    /// it into the span's row without unpacking that row first.
    KeepLoose,
}

const GPU_FIGURES: &[&str] = &[
    "used_min",
    "used_max",
    "used_avg",
    "used_last",
    "reserved",
    "total",
    "utilization",
    "pcie_tx",
    "pcie_rx",
];
const PROCESS_FIGURES: &[&str] = &["used_min", "used_max", "used_avg", "used_last"];

const GPU_MINUTES: PackedRollups = PackedRollups {
    loose: "gpu_samples_1m",
    packed: "gpu_samples_1m_packed",
    key: "device_id",
    figures: GPU_FIGURES,
    span_column: "hour_ms",
    slot_column: "minute",
    step_ms: MINUTE_MS,
    on_conflict: OnConflict::Merge(Some(GPU_FIGURES_MERGED)),
};

const PROCESS_MINUTES: PackedRollups = PackedRollups {
    loose: "process_samples_1m",
    packed: "process_samples_1m_packed",
    key: "process_id",
    figures: PROCESS_FIGURES,
    span_column: "hour_ms",
    slot_column: "minute",
    step_ms: MINUTE_MS,
    on_conflict: OnConflict::Merge(None),
};

const GPU_HOURS: PackedRollups = PackedRollups {
    loose: "gpu_samples_1h",
    packed: "gpu_samples_1h_packed",
    key: "device_id",
    figures: GPU_FIGURES,
    span_column: "day_ms",
    slot_column: "hour",
    step_ms: HOUR_MS,
    on_conflict: OnConflict::KeepLoose,
};

const PROCESS_HOURS: PackedRollups = PackedRollups {
    loose: "process_samples_1h",
    packed: "process_samples_1h_packed",
    key: "process_id",
    figures: PROCESS_FIGURES,
    span_column: "day_ms",
    slot_column: "hour",
    step_ms: HOUR_MS,
    on_conflict: OnConflict::KeepLoose,
};

impl PackedRollups {
    /// The figures' columns of `table`, a list for a SELECT.
    fn figures_of(&self, table: &str) -> String {
        self.figures
            .iter()
            .map(|f| format!("{table}.{f}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Deletes the packed rows that `packed_rows` (a `WHERE` clause over
    /// `p`) picks and puts their buckets back as loose rows.
    fn unpack_sql(&self, packed_rows: &str) -> String {
        let Self {
            loose,
            packed,
            key,
            span_column: span,
            slot_column: slot,
            step_ms: step,
            ..
        } = self;
        let figures = self.figures.join(", ");
        let (of_bucket, of_gone) = (self.figures_of("m"), self.figures_of("g"));
        let on_conflict = match self.on_conflict {
            OnConflict::Merge(Some(more)) => format!("DO UPDATE SET {MERGED_MEMORY}, {more}"),
            OnConflict::Merge(None) => format!("DO UPDATE SET {MERGED_MEMORY}"),
            // Hours are folded by packing, never unpacked; were one, the
            // loose hour would still win.
            OnConflict::KeepLoose => "DO NOTHING".to_string(),
        };
        format!(
            "WITH gone AS (DELETE FROM {packed} p {packed_rows} RETURNING p.*)
             INSERT INTO {loose} AS r ({key}, ts_ms, last_ts_ms, samples, {figures})
             SELECT g.{key}, g.{span} + m.{slot} * {step}::int8,
                 g.{span} + m.{slot} * {step}::int8 + m.last_offset_ms, m.samples, {of_bucket}
             FROM gone g,
                 LATERAL unnest(g.{slot}, g.last_offset_ms, g.samples, {of_gone})
                     AS m({slot}, last_offset_ms, samples, {figures})
             ON CONFLICT ({key}, ts_ms) {on_conflict}"
        )
    }

    /// Moves the loose buckets of the span `$1` (`$2` long, of buckets
    /// `$3` long) of the series `$4` into a packed row per series; returns
    /// the rows moved. Where the loose bucket wins ([`OnConflict::KeepLoose`])
    /// a series' packed row is folded in within the statement: its buckets
    /// that no loose one replaces are packed with the loose ones. (A
    /// statement in WITH runs in full whether or not the query reads it.
    /// The ordered `array_agg`s make the grouping sort every bucket before
    /// it yields a row, so each old packed row is deleted before its
    /// replacement is inserted: keep them ordered.)
    fn pack_sql(&self) -> String {
        let Self {
            loose,
            packed,
            key,
            span_column: span,
            slot_column: slot,
            ..
        } = self;
        let figures = self.figures.join(", ");
        let arrays = self
            .figures
            .iter()
            .map(|f| format!("array_agg({f} ORDER BY ts_ms)"))
            .collect::<Vec<_>>()
            .join(", ");
        let (folded, buckets) = match self.on_conflict {
            OnConflict::Merge(_) => (String::new(), "gone".to_string()),
            OnConflict::KeepLoose => {
                let (of_bucket, of_was) = (self.figures_of("m"), self.figures_of("w"));
                (
                    format!(
                        ", was AS (
                             DELETE FROM {packed} p WHERE p.{span} = $1 AND p.{key} = ANY($4::int8[])
                             RETURNING p.*)"
                    ),
                    format!(
                        "(SELECT {key}, ts_ms, last_ts_ms, samples, {figures} FROM gone
                          UNION ALL
                          SELECT w.{key}, w.{span} + m.{slot} * $3, w.{span} + m.{slot} * $3 + m.last_offset_ms,
                              m.samples, {of_bucket}
                          FROM was w,
                              LATERAL unnest(w.{slot}, w.last_offset_ms, w.samples, {of_was})
                                  AS m({slot}, last_offset_ms, samples, {figures})
                          WHERE NOT EXISTS (SELECT 1 FROM gone g
                              WHERE g.{key} = w.{key} AND g.ts_ms = w.{span} + m.{slot} * $3)) AS buckets"
                    ),
                )
            }
        };
        format!(
            "WITH gone AS (
                 DELETE FROM {loose} WHERE {key} = ANY($4::int8[]) AND ts_ms >= $1 AND ts_ms < $1 + $2
                 RETURNING *){folded},
             packed AS (
                 INSERT INTO {packed} ({span}, {key}, {slot}, last_offset_ms, samples, {figures})
                 SELECT $1, {key}, array_agg(((ts_ms - $1) / $3)::int2 ORDER BY ts_ms),
                     array_agg((last_ts_ms - ts_ms)::int4 ORDER BY ts_ms),
                     array_agg(samples ORDER BY ts_ms), {arrays}
                 FROM {buckets} GROUP BY {key})
             SELECT count(*) FROM gone"
        )
    }
}

/// One span's rollups of both kinds of series, and the lock packing them
/// takes.
struct Span {
    kinds: [&'static PackedRollups; 2],
    span_ms: i64,
    lock: i64,
}

const HOUR_OF_MINUTES: Span = Span {
    kinds: [&GPU_MINUTES, &PROCESS_MINUTES],
    span_ms: HOUR_MS,
    lock: MINUTE_PACKING_LOCK,
};

const DAY_OF_HOURS: Span = Span {
    kinds: [&GPU_HOURS, &PROCESS_HOURS],
    span_ms: DAY_MS,
    lock: HOUR_PACKING_LOCK,
};

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
    pack_span(pool, &HOUR_OF_MINUTES, hour, None).await
}

/// A day's hour rollups are packed once the day after it has ended too:
/// the day before is where a spool replayed after an outage lands, and an
/// hour redone in a packed day has the day's row of each series it was
/// redone for rewritten by the next pass.
const DAY_PACKED_AFTER_MS: i64 = DAY_MS;

/// Packs the hour rollups of the days marked in `hour_packing_pending` (by
/// triggers on the hour tables) that are final, oldest first, until
/// `deadline`.
/// Returns the hour rows packed. A day whose rollups are not final stays
/// marked; so does one given loose hours meanwhile.
pub(super) async fn pack_closed_days(
    pool: &PgPool,
    hour_watermark_ms: i64,
    oldest_kept_ms: i64,
    deadline: Instant,
) -> Result<u64, StoreError> {
    // Days past the hour rollups' retention (marked by the upgrade) are
    // dropped with their partitions, not packed.
    sqlx::query("DELETE FROM hour_packing_pending WHERE day_ms < $1")
        .bind(bucket_start(oldest_kept_ms, DAY_MS))
        .execute(pool)
        .await?;
    let days: Vec<i64> = sqlx::query_scalar(
        "SELECT day_ms FROM hour_packing_pending WHERE day_ms <= $1 ORDER BY day_ms LIMIT 32",
    )
    .bind(hour_watermark_ms - DAY_MS - DAY_PACKED_AFTER_MS)
    .fetch_all(pool)
    .await?;
    let mut moved = 0;
    // At least one transaction a pass, however short its packing time.
    for day in days {
        let packed_tables = DAY_OF_HOURS.kinds.map(|kind| kind.packed);
        ensure_partitions_of(pool, &packed_tables, day, day).await?;
        let Some(rows) = pack_span(pool, &DAY_OF_HOURS, day, Some(deadline)).await? else {
            continue;
        };
        moved += rows;
        // Unmarked only where no loose hour is left, under the lock the
        // hour rollups share: an hour redone while the day was packed
        // batch by batch, or series left at the deadline, are packed by
        // the next pass.
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(HOUR_PACKING_LOCK)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "DELETE FROM hour_packing_pending WHERE day_ms = $1
                 AND NOT EXISTS (SELECT 1 FROM gpu_samples_1h WHERE ts_ms >= $1 AND ts_ms < $1 + $2)
                 AND NOT EXISTS (SELECT 1 FROM process_samples_1h WHERE ts_ms >= $1 AND ts_ms < $1 + $2)",
        )
        .bind(day)
        .bind(DAY_MS)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        if Instant::now() >= deadline {
            break;
        }
    }
    Ok(moved)
}

/// Packs the rollups of the span starting at `start`, both kinds of series,
/// [`SERIES_PER_TRANSACTION`] at a time, if they are final; `None` where
/// they are not. Past `deadline` it stops after a transaction, leaving the
/// other series loose.
async fn pack_span(
    pool: &PgPool,
    span: &Span,
    start: i64,
    deadline: Option<Instant>,
) -> Result<Option<u64>, StoreError> {
    let mut moved = 0;
    for tables in span.kinds {
        let PackedRollups { loose, key, .. } = tables;
        let series: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT DISTINCT {key}::int8 FROM {loose} WHERE ts_ms >= $1 AND ts_ms < $1 + $2 ORDER BY 1"
        ))
        .bind(start)
        .bind(span.span_ms)
        .fetch_all(pool)
        .await?;
        for batch in series.chunks(SERIES_PER_TRANSACTION) {
            match pack_series(pool, span, tables, start, batch).await? {
                Some(rows) => moved += rows,
                None => return Ok(None),
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(Some(moved));
            }
        }
    }
    Ok(Some(moved))
}

/// Packs the buckets of the span at `start` of `series` in one
/// transaction, if the span's rollups are final: the hours rolled up past
/// its end, and none of its minutes or hours waiting to be rolled up again.
async fn pack_series(
    pool: &PgPool,
    span: &Span,
    tables: &PackedRollups,
    start: i64,
    series: &[i64],
) -> Result<Option<u64>, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(span.lock)
        .execute(&mut *tx)
        .await?;
    let is_final: bool = sqlx::query_scalar(
        "SELECT COALESCE((SELECT done_until_ms FROM rollup_progress WHERE step_ms = $3), 0) >= $1 + $2
             AND NOT EXISTS (SELECT 1 FROM rollup_pending
                 WHERE step_ms IN ($3, $4) AND bucket_ms >= $1 AND bucket_ms < $1 + $2)
             AND NOT EXISTS (SELECT 1 FROM hour_redo_series WHERE hour_ms >= $1 AND hour_ms < $1 + $2)",
    )
    .bind(start)
    .bind(span.span_ms)
    .bind(HOUR_MS)
    .bind(MINUTE_MS)
    .fetch_one(&mut *tx)
    .await?;
    if !is_final {
        return Ok(None);
    }
    // A series' span of minutes packed and loose at once (minutes written
    // by a collector older than packing, during a rolling upgrade) is
    // unpacked first, its minutes merged with the loose ones, then packed
    // whole. Hours need no unpacking: the packing statement folds them.
    if let OnConflict::Merge(_) = tables.on_conflict {
        let PackedRollups {
            loose,
            key,
            span_column,
            ..
        } = tables;
        sqlx::query(&tables.unpack_sql(&format!(
            "WHERE p.{span_column} = $1 AND p.{key} = ANY($3::int8[]) AND EXISTS (SELECT 1 FROM {loose} r
                 WHERE r.{key} = p.{key} AND r.ts_ms >= $1 AND r.ts_ms < $1 + $2)"
        )))
        .bind(start)
        .bind(span.span_ms)
        .bind(series)
        .execute(&mut *tx)
        .await?;
    }
    let rows: i64 = sqlx::query_scalar(&tables.pack_sql())
        .bind(start)
        .bind(span.span_ms)
        .bind(tables.step_ms)
        .bind(series)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(u64::try_from(rows).unwrap_or(0)))
}

/// Before a flush merges minutes older than the minute watermark (the GPU
/// and process series hours they fall in, `Encoded::late_series_hours`):
/// unpacks the hours of those series that were packed. Newer
/// minutes need nothing: an hour is packed only once the hour watermark,
/// which trails the minute watermark, passed it, and the flush holds the
/// minute watermark where it is until it commits.
pub(super) async fn unpack_for_late_minutes(
    tx: &mut Transaction<'_, Postgres>,
    (gpu, process): (&SeriesHours, &SeriesHours),
) -> Result<(), StoreError> {
    let late = [(&GPU_MINUTES, gpu), (&PROCESS_MINUTES, process)];
    if late.iter().all(|(_, series_hours)| series_hours.is_empty()) {
        return Ok(());
    }
    share(tx, MINUTE_PACKING_LOCK).await?;
    for (tables, series_hours) in late {
        if series_hours.is_empty() {
            continue;
        }
        let key = tables.key;
        let (series, hours): (Vec<i64>, Vec<i64>) = series_hours.iter().copied().unzip();
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
    share(tx, MINUTE_PACKING_LOCK).await?;
    for (tables, raw) in [
        (&GPU_MINUTES, "gpu_samples"),
        (&PROCESS_MINUTES, "process_samples"),
    ] {
        let key = tables.key;
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

/// Before hours are rolled up again: holds off packing their days until
/// the transaction ends. Hours redone inside a packed day are written loose
/// beside it and read in place of their packed copies until the next pass
/// folds them in; a pass that unmarked the day while they were being
/// written would leave them loose for good.
pub(super) async fn before_hour_rollup(
    tx: &mut Transaction<'_, Postgres>,
) -> Result<(), StoreError> {
    share(tx, HOUR_PACKING_LOCK).await
}

/// Takes `lock` shared for the rest of the transaction: unpacking shares
/// it, packing takes it alone.
async fn share(tx: &mut Transaction<'_, Postgres>, lock: i64) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
        .bind(lock)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
