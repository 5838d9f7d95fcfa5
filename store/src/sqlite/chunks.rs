//! Samples as chunks on SQLite, the design Postgres has
//! (store/postgres/chunk_flush.rs, compaction.rs): a flush writes the open
//! chunks' samples as one compressed chunk per series and hour they touch
//! (store/src/chunk_format.rs), merges their minute rollups, marks the
//! minutes the rollup pass already passed for it to sum again, and raises
//! each stream's durable mark, in one transaction. Charts decode chunks on
//! the way out. Once an hour is closed, maintenance rewrites each series'
//! chunks of it as one.
//!
//! One collector owns an SQLite file, so no other can have written a
//! stream's samples first: a flush needs no locks beyond SQLite's one
//! writer, and leaves nothing out.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{Row, Sqlite, Transaction};

use crate::StoreError;
use crate::chart_fold::AllocatorFold;
use crate::chunk_format::{self, Chunk, ChunkTable, Compressor};
use crate::flush_encoding::{Encoded, encode_off_runtime};
use crate::model::{AllocatorReport, GpuSampleRow, ProcessPoint};
use crate::open_chunks::{GpuMinute, ProcessMinute, Samples, StreamKey};
use crate::rollup::{HOUR_MS, MINUTE_MS};

/// What a flush wrote.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Flushed {
    pub chunks: usize,
    pub chunk_bytes: usize,
    pub samples: usize,
    /// Each stream's durable mark after the flush.
    pub marks: Vec<(StreamKey, u64)>,
}

/// Writes `taken` and commits; see the module's notes.
pub(super) async fn write_open_chunks(
    pool: &SqlitePool,
    taken: Arc<Samples>,
) -> Result<Flushed, StoreError> {
    let encoded = encode_off_runtime(taken.clone()).await?;
    let marks: Vec<(StreamKey, u64)> = taken
        .last_seqs()
        .into_iter()
        .map(|(key, seq)| (key.clone(), seq))
        .collect();
    let mut tx = pool.begin().await?;
    // A write first, so the transaction holds SQLite's write lock from its
    // start (a read first would make it fail, not wait, on a busy file).
    for ((node_id, boot_id), seq) in &marks {
        sqlx::query(
            "UPDATE agent_boots SET durable_seq = MAX(durable_seq, ?3) WHERE node_id = ?1 AND boot_id = ?2",
        )
        .bind(node_id)
        .bind(boot_id)
        .bind(i64::try_from(*seq).unwrap_or(i64::MAX))
        .execute(&mut *tx)
        .await?;
    }
    insert_chunks::<GpuSampleRow>(&mut tx, &encoded.gpu_chunks).await?;
    insert_chunks::<ProcessPoint>(&mut tx, &encoded.process_chunks).await?;
    insert_chunks::<AllocatorReport>(&mut tx, &encoded.allocator_chunks).await?;
    for minute in &encoded.gpu_minutes {
        merge_gpu_minute(&mut tx, minute).await?;
    }
    for minute in &encoded.process_minutes {
        merge_process_minute(&mut tx, minute).await?;
    }
    mark_late_minutes(&mut tx, &encoded).await?;
    mark_for_compaction(&mut tx, &encoded).await?;
    tx.commit().await?;
    Ok(Flushed {
        chunks: encoded.chunks().count(),
        chunk_bytes: encoded.chunks().map(Chunk::bytes).sum(),
        samples: encoded.samples(),
        marks,
    })
}

async fn insert_chunks<T: ChunkTable>(
    tx: &mut Transaction<'_, Sqlite>,
    chunks: &[Chunk],
) -> Result<(), StoreError> {
    let (minutes_column, minutes_value) = if T::MINUTES {
        (", minutes", ", ?7")
    } else {
        ("", "")
    };
    let sql = format!(
        "INSERT INTO {table} ({key}, hour_ms, first_ts_ms, last_ts_ms, samples, data{minutes_column})
         VALUES (?1, ?2, ?3, ?4, ?5, ?6{minutes_value})",
        table = T::TABLE,
        key = T::KEY,
    );
    for chunk in chunks {
        let insert = sqlx::query(&sql)
            .bind(chunk.key)
            .bind(chunk.hour_ms)
            .bind(chunk.first_ts_ms)
            .bind(chunk.last_ts_ms)
            .bind(chunk.samples)
            .bind(&chunk.data);
        let insert = if T::MINUTES {
            insert.bind(chunk.minutes.as_deref())
        } else {
            insert
        };
        insert.execute(&mut **tx).await?;
    }
    Ok(())
}

/// A minute row `r` merged with the same minute's `excluded` one: the
/// memory figures both rollup tables share. SQLite evaluates every
/// assignment against the row as it was.
const MERGED_MEMORY: &str = "samples = r.samples + excluded.samples,
    last_ts_ms = MAX(r.last_ts_ms, excluded.last_ts_ms),
    used_last = CASE WHEN excluded.last_ts_ms >= r.last_ts_ms THEN excluded.used_last ELSE r.used_last END,
    used_min = MIN(r.used_min, excluded.used_min),
    used_max = MAX(r.used_max, excluded.used_max),
    used_avg = CAST(ROUND((CAST(r.used_avg AS REAL) * r.samples + CAST(excluded.used_avg AS REAL) * excluded.samples)
        / (r.samples + excluded.samples)) AS INTEGER)";

/// The mean of an optional figure over both rows' samples that have it.
fn merged_mean(column: &str) -> String {
    format!(
        "(COALESCE(CAST(r.{column} AS REAL) * r.samples, 0) + COALESCE(CAST(excluded.{column} AS REAL) * excluded.samples, 0))
         / NULLIF(CASE WHEN r.{column} IS NULL THEN 0 ELSE r.samples END
             + CASE WHEN excluded.{column} IS NULL THEN 0 ELSE excluded.samples END, 0)"
    )
}

/// Merges a minute into `gpu_samples_1m`: a minute already there (the same
/// minute's earlier samples, or a late batch's) ends as the rollup of all
/// of them, each mean weighted by how many samples it holds.
async fn merge_gpu_minute(
    tx: &mut Transaction<'_, Sqlite>,
    m: &GpuMinute,
) -> Result<(), StoreError> {
    sqlx::query(&format!(
        "INSERT INTO gpu_samples_1m AS r (device_id, ts_ms, last_ts_ms, samples, used_min, used_max,
             used_avg, used_last, reserved, total, utilization, pcie_tx, pcie_rx)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)
         ON CONFLICT (device_id, ts_ms) DO UPDATE SET {MERGED_MEMORY},
             reserved = MAX(r.reserved, excluded.reserved),
             total = MAX(r.total, excluded.total),
             utilization = {utilization},
             pcie_tx = CAST(ROUND({pcie_tx}) AS INTEGER),
             pcie_rx = CAST(ROUND({pcie_rx}) AS INTEGER)",
        utilization = merged_mean("utilization"),
        pcie_tx = merged_mean("pcie_tx"),
        pcie_rx = merged_mean("pcie_rx"),
    ))
    .bind(m.device_id)
    .bind(m.minute_ms)
    .bind(m.last_ts_ms)
    .bind(m.samples)
    .bind(m.used_min)
    .bind(m.used_max)
    .bind(m.used_avg())
    .bind(m.used_last)
    .bind(m.reserved)
    .bind(m.total)
    .bind(
        (m.utilization_samples > 0)
            .then(|| m.utilization_sum as f64 / m.utilization_samples as f64),
    )
    .bind(m.pcie_tx())
    .bind(m.pcie_rx())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn merge_process_minute(
    tx: &mut Transaction<'_, Sqlite>,
    m: &ProcessMinute,
) -> Result<(), StoreError> {
    sqlx::query(&format!(
        "INSERT INTO process_samples_1m AS r (process_id, ts_ms, last_ts_ms, samples, used_min,
             used_max, used_avg, used_last)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
         ON CONFLICT (process_id, ts_ms) DO UPDATE SET {MERGED_MEMORY}"
    ))
    .bind(m.process_id)
    .bind(m.minute_ms)
    .bind(m.last_ts_ms)
    .bind(m.samples)
    .bind(m.used_min)
    .bind(m.used_max)
    .bind(m.used_avg())
    .bind(m.used_last)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Minutes the rollup pass already passed (a spool replayed after an
/// outage) go back on its list: it sums their fleet row again and rolls
/// their hour up again. Their device rows are merged already.
async fn mark_late_minutes(
    tx: &mut Transaction<'_, Sqlite>,
    encoded: &Encoded,
) -> Result<(), StoreError> {
    let done_until: Option<i64> =
        sqlx::query_scalar("SELECT done_until_ms FROM rollup_progress WHERE step_ms = ?1")
            .bind(MINUTE_MS)
            .fetch_optional(&mut **tx)
            .await?;
    let Some(done_until) = done_until else {
        return Ok(());
    };
    for minute in encoded.minutes_before(done_until) {
        sqlx::query(
            "INSERT INTO rollup_pending (step_ms, bucket_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
        )
        .bind(MINUTE_MS)
        .bind(minute)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

async fn mark_for_compaction(
    tx: &mut Transaction<'_, Sqlite>,
    encoded: &Encoded,
) -> Result<(), StoreError> {
    for hour in encoded.hours() {
        sqlx::query("INSERT INTO compact_pending (hour_ms) VALUES (?1) ON CONFLICT DO NOTHING")
            .bind(hour)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

fn chunk_of(row: &SqliteRow) -> Result<Chunk, sqlx::Error> {
    Ok(Chunk {
        data: row.try_get("data")?,
        ..chunk_header(row)?
    })
}

/// A chunk's row but its bytes.
fn chunk_header(row: &SqliteRow) -> Result<Chunk, sqlx::Error> {
    Ok(Chunk {
        key: row.try_get("key")?,
        hour_ms: row.try_get("hour_ms")?,
        first_ts_ms: row.try_get("first_ts_ms")?,
        last_ts_ms: row.try_get("last_ts_ms")?,
        samples: row.try_get("samples")?,
        data: Vec::new(),
        minutes: None,
    })
}

/// The allocator chunks of process `process_id` in `[from_ms, to_ms]`
/// folded into `fold`. Where `by_minute` (the chart's buckets are a minute
/// or wider), a chunk that lies wholly in the range and keeps its minutes
/// is read as those alone: its reports are not read.
pub(super) async fn fold_allocator_chunks(
    pool: &SqlitePool,
    process_id: i64,
    (from_ms, to_ms): (i64, i64),
    by_minute: bool,
    fold: &mut AllocatorFold,
) -> Result<(), StoreError> {
    if from_ms > to_ms {
        return Ok(());
    }
    let chunks = sqlx::query(
        "SELECT id, process_id AS key, hour_ms, first_ts_ms, last_ts_ms, samples,
             CASE WHEN whole THEN NULL ELSE data END AS data, CASE WHEN whole THEN minutes END AS minutes
         FROM (SELECT rowid AS id, process_id, hour_ms, first_ts_ms, last_ts_ms, samples, minutes, data,
                   ?5 AND minutes IS NOT NULL AND first_ts_ms >= ?4 AND last_ts_ms <= ?3 AS whole
               FROM allocator_samples_packed
               WHERE process_id = ?1 AND hour_ms >= ?2 AND hour_ms <= ?3 AND last_ts_ms >= ?4
                 AND first_ts_ms <= ?3)",
    )
    .bind(process_id)
    .bind(crate::rollup::bucket_start(from_ms, HOUR_MS))
    .bind(to_ms)
    .bind(from_ms)
    .bind(by_minute)
    .fetch_all(pool)
    .await?;
    for row in &chunks {
        let chunk = Chunk {
            data: row
                .try_get::<Option<Vec<u8>>, _>("data")?
                .unwrap_or_default(),
            minutes: row.try_get("minutes")?,
            ..chunk_header(row)?
        };
        if chunk_format::fold_allocator_chunk(fold, &chunk, from_ms, to_ms) {
            continue;
        }
        // Its minutes are damaged: its reports, then, unless compaction or
        // retention took the chunk meanwhile.
        let rowid: i64 = row.try_get("id")?;
        let Some(data) = sqlx::query_scalar::<_, Vec<u8>>(
            "SELECT data FROM allocator_samples_packed WHERE rowid = ?1",
        )
        .bind(rowid)
        .fetch_optional(pool)
        .await?
        else {
            continue;
        };
        let whole = Chunk {
            data,
            minutes: None,
            ..chunk
        };
        chunk_format::fold_allocator_chunk(fold, &whole, from_ms, to_ms);
    }
    Ok(())
}

/// The chunked samples of `series` in `[from_ms, to_ms]`, decoded. A chunk
/// that does not decode is named in the log and left out.
pub(super) async fn samples_between<T: ChunkTable>(
    pool: &SqlitePool,
    series: &[i64],
    from_ms: i64,
    to_ms: i64,
) -> Result<Vec<T>, StoreError> {
    let mut rows = Vec::new();
    each_sample_between(pool, series, (from_ms, to_ms), |r| rows.push(r)).await?;
    Ok(rows)
}

/// [`samples_between`] handed to `each` a chunk at a time, so that a long
/// range is never in memory decoded all at once.
pub(super) async fn each_sample_between<T: ChunkTable>(
    pool: &SqlitePool,
    series: &[i64],
    (from_ms, to_ms): (i64, i64),
    mut each: impl FnMut(T),
) -> Result<(), StoreError> {
    if series.is_empty() || from_ms > to_ms {
        return Ok(());
    }
    let keys = serde_json::to_string(series)
        .map_err(|e| StoreError::Invalid(format!("series ids as JSON: {e}")))?;
    let chunks = sqlx::query(&format!(
        "SELECT {key} AS key, hour_ms, first_ts_ms, last_ts_ms, samples, data FROM {table}
         WHERE {key} IN (SELECT value FROM json_each(?1)) AND hour_ms >= ?2 AND hour_ms <= ?3
           AND last_ts_ms >= ?4 AND first_ts_ms <= ?3",
        key = T::KEY,
        table = T::TABLE,
    ))
    .bind(keys)
    .bind(crate::rollup::bucket_start(from_ms, HOUR_MS))
    .bind(to_ms)
    .bind(from_ms)
    .fetch_all(pool)
    .await?;
    let mut decoded = Vec::new();
    for chunk in &chunks {
        chunk_format::extend_for_chart(&mut decoded, &chunk_of(chunk)?, T::TABLE, from_ms, to_ms);
        decoded.drain(..).for_each(&mut each);
    }
    Ok(())
}

/// An hour is compacted once it ended this long ago: its last flush (at
/// most a minute after its last sample) has long committed.
const CLOSED_AFTER_MS: i64 = 5 * MINUTE_MS;

/// Compacts marked closed hours, oldest first, until `deadline`; returns
/// how many chunks it folded away (chunks read minus chunks written). Each
/// hour is one transaction that also takes its mark, so an hour whose
/// compaction fails stays marked for the next pass.
pub(super) async fn compact_closed_hours(
    pool: &SqlitePool,
    now_ms: i64,
    deadline: Instant,
) -> Result<u64, StoreError> {
    let hours: Vec<i64> = sqlx::query_scalar(
        "SELECT hour_ms FROM compact_pending WHERE hour_ms <= ?1 ORDER BY hour_ms LIMIT 48",
    )
    .bind(now_ms - HOUR_MS - CLOSED_AFTER_MS)
    .fetch_all(pool)
    .await?;
    let mut folded = 0;
    for hour in hours {
        let mut tx = pool.begin().await?;
        sqlx::query("DELETE FROM compact_pending WHERE hour_ms = ?1")
            .bind(hour)
            .execute(&mut *tx)
            .await?;
        folded += compact_hour::<GpuSampleRow>(&mut tx, hour).await?;
        folded += compact_hour::<ProcessPoint>(&mut tx, hour).await?;
        folded += compact_hour::<AllocatorReport>(&mut tx, hour).await?;
        tx.commit().await?;
        if Instant::now() >= deadline {
            break;
        }
    }
    Ok(folded)
}

/// Rewrites each series' chunks of `hour` as one. A chunk that does not
/// decode stays as it is, beside the new one.
async fn compact_hour<T: ChunkTable>(
    tx: &mut Transaction<'_, Sqlite>,
    hour: i64,
) -> Result<u64, StoreError> {
    let rows = sqlx::query(&format!(
        "SELECT rowid, {key} AS key, hour_ms, first_ts_ms, last_ts_ms, samples, data FROM {table}
         WHERE hour_ms = ?1 AND {key} IN (
             SELECT {key} FROM {table} WHERE hour_ms = ?1 GROUP BY {key} HAVING COUNT(*) > 1)",
        key = T::KEY,
        table = T::TABLE,
    ))
    .bind(hour)
    .fetch_all(&mut **tx)
    .await?;
    let mut by_series: BTreeMap<i64, Vec<(i64, Chunk)>> = BTreeMap::new();
    for row in &rows {
        let rowid: i64 = row.try_get("rowid")?;
        let chunk = chunk_of(row)?;
        by_series.entry(chunk.key).or_default().push((rowid, chunk));
    }
    let mut compressor =
        Compressor::new().map_err(|e| StoreError::Invalid(format!("no zstd context: {e}")))?;
    let mut folded = 0u64;
    for (key, chunks) in by_series {
        let (rowids, chunks): (Vec<i64>, Vec<&Chunk>) = chunks.iter().map(|(r, c)| (*r, c)).unzip();
        let Some((folded_away, compacted)) =
            chunk_format::compact_series::<T>(&mut compressor, T::TABLE, &chunks)
                .map_err(|e| StoreError::Damaged(format!("compacting series {key}: {e}")))?
        else {
            continue;
        };
        let replaced: Vec<i64> = folded_away.into_iter().map(|i| rowids[i]).collect();
        let delete = format!("DELETE FROM {} WHERE rowid = ?1", T::TABLE);
        for rowid in &replaced {
            sqlx::query(&delete).bind(rowid).execute(&mut **tx).await?;
        }
        insert_chunks::<T>(tx, &compacted).await?;
        folded += (replaced.len() as u64).saturating_sub(compacted.len() as u64);
    }
    Ok(folded)
}
