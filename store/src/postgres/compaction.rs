//! Compaction of closed hours. A flush writes a chunk per series for the
//! minute or so it held, so that samples are on disk within a minute; but a
//! minute of a series compresses less well than an hour, and each chunk
//! costs a row (about 90 bytes with its index entry) and a read. Once an
//! hour is closed, the maintenance pass rewrites each series' chunks of it
//! as one, the format packed days use.
//!
//! Each flush marks the hours it wrote chunks for (`compact_pending`); a
//! pass takes marked hours that ended [`CLOSED_AFTER_MS`] ago, oldest
//! first, within a time budget. A late chunk (a spool replayed after an
//! outage) marks its hour again, and the next pass folds it in. A chunk that
//! does not decode is left as it is, beside the compacted one.
//!
//! The same pass packs the hour's minute rollups once they are final
//! (`rollup_packing.rs`); an hour whose rollups are not is marked again.

use std::collections::BTreeMap;
use std::time::Instant;

use sqlx::postgres::PgPool;
use sqlx::{Postgres, Transaction};

use super::packing::{chunk_row, insert_chunks};
use super::rollup_packing::pack_hour;
use crate::StoreError;
use crate::chunk_format::{self as packed, Chunk, ChunkTable, Compressor};
use crate::model::{AllocatorReport, GpuSampleRow, ProcessPoint};
use crate::rollup::{HOUR_MS, MINUTE_MS};

/// An hour is compacted once it ended this long ago: its last flush (at
/// most a minute after its last sample) has long committed.
pub(super) const CLOSED_AFTER_MS: i64 = 5 * MINUTE_MS;

/// Series rewritten per transaction.
const SERIES_PER_TRANSACTION: usize = 500;

/// What a compaction pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Compacted {
    /// Chunks read minus chunks written.
    pub chunks_folded: u64,
    /// Minute rollup rows moved into packed hours.
    pub minute_rows_packed: u64,
}

/// Compacts marked hours until `deadline`.
pub(super) async fn compact_closed_hours(
    pool: &PgPool,
    now_ms: i64,
    deadline: Instant,
) -> Result<Compacted, StoreError> {
    let hours: Vec<i64> = sqlx::query_scalar(
        "SELECT hour_ms FROM compact_pending WHERE hour_ms <= $1 ORDER BY hour_ms LIMIT 48",
    )
    .bind(now_ms - HOUR_MS - CLOSED_AFTER_MS)
    .fetch_all(pool)
    .await?;
    let mut done = Compacted::default();
    for hour in hours {
        // Taken before the work: a flush that writes into the hour
        // meanwhile marks it again, for the next pass. Put back if the
        // work fails, so the hour is not left as minute chunks for good.
        sqlx::query("DELETE FROM compact_pending WHERE hour_ms = $1")
            .bind(hour)
            .execute(pool)
            .await?;
        let compacted = async {
            let folded = compact_hour::<GpuSampleRow>(pool, hour).await?
                + compact_hour::<ProcessPoint>(pool, hour).await?
                + compact_hour::<AllocatorReport>(pool, hour).await?;
            Ok::<_, StoreError>((folded, pack_hour(pool, hour).await?))
        }
        .await;
        match compacted {
            Ok((folded, packed)) => {
                done.chunks_folded += folded;
                match packed {
                    Some(rows) => done.minute_rows_packed += rows,
                    // Its rollups are redone first, by a later pass.
                    None => mark_again(pool, hour).await?,
                }
            }
            Err(error) => {
                if let Err(mark_error) = mark_again(pool, hour).await {
                    tracing::error!(hour_ms = hour, %mark_error,
                        "could not mark an hour whose compaction failed; it stays as minute chunks");
                }
                return Err(error);
            }
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    Ok(done)
}

async fn mark_again(pool: &PgPool, hour: i64) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO compact_pending (hour_ms) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(hour)
        .execute(pool)
        .await?;
    Ok(())
}

/// The series with chunks in `hour`, by the tables' BRIN index on the
/// hour: chunks go in roughly in time order, so an hour's are a few block
/// ranges of its day's partition.
async fn series_of_hour<T: ChunkTable>(pool: &PgPool, hour: i64) -> Result<Vec<i64>, StoreError> {
    Ok(sqlx::query_scalar(&format!(
        "SELECT DISTINCT {key}::int8 FROM {packed} WHERE hour_ms = $1 ORDER BY 1",
        key = T::KEY,
        packed = T::TABLE,
    ))
    .bind(hour)
    .fetch_all(pool)
    .await?)
}

async fn compact_hour<T: ChunkTable>(pool: &PgPool, hour: i64) -> Result<u64, StoreError> {
    let series = series_of_hour::<T>(pool, hour).await?;
    let mut compressor =
        Compressor::new().map_err(|e| StoreError::Invalid(format!("no zstd context: {e}")))?;
    let mut folded = 0;
    for batch in series.chunks(SERIES_PER_TRANSACTION) {
        let mut tx = pool.begin().await?;
        let rows = sqlx::query(&format!(
            "SELECT {key}::int8 AS key, hour_ms, first_ts_ms, last_ts_ms, samples, data FROM {packed}
             WHERE {key} = ANY($1) AND hour_ms = $2 FOR UPDATE",
            key = T::KEY,
            packed = T::TABLE,
        ))
        .bind(batch)
        .bind(hour)
        .fetch_all(&mut *tx)
        .await?;
        let mut by_series: BTreeMap<i64, Vec<Chunk>> = BTreeMap::new();
        for row in &rows {
            let chunk = chunk_row(row)?;
            by_series.entry(chunk.key).or_default().push(chunk);
        }
        let mut replaced: Vec<&Chunk> = Vec::new();
        let mut written = Vec::new();
        for (key, chunks) in &by_series {
            let chunks: Vec<&Chunk> = chunks.iter().collect();
            let Some((folded_away, compacted)) =
                packed::compact_series::<T>(&mut compressor, T::TABLE, &chunks).map_err(|e| {
                    StoreError::Damaged(format!("compacting {} {key}: {e}", T::KEY))
                })?
            else {
                continue;
            };
            replaced.extend(folded_away.into_iter().map(|i| chunks[i]));
            written.extend(compacted);
        }
        if replaced.is_empty() {
            tx.rollback().await?;
            continue;
        }
        delete_chunks::<T>(&mut tx, hour, &replaced).await?;
        insert_chunks::<T>(&mut tx, &written).await?;
        tx.commit().await?;
        folded += replaced.len().saturating_sub(written.len()) as u64;
    }
    Ok(folded)
}

async fn delete_chunks<T: ChunkTable>(
    tx: &mut Transaction<'_, Postgres>,
    hour: i64,
    chunks: &[&Chunk],
) -> Result<(), StoreError> {
    sqlx::query(&format!(
        "DELETE FROM {packed} WHERE hour_ms = $1 AND ({key}, first_ts_ms, last_ts_ms) IN
             (SELECT * FROM UNNEST($2::int8[], $3::int8[], $4::int8[]))",
        key = T::KEY,
        packed = T::TABLE,
    ))
    .bind(hour)
    .bind(chunks.iter().map(|c| c.key).collect::<Vec<_>>())
    .bind(chunks.iter().map(|c| c.first_ts_ms).collect::<Vec<_>>())
    .bind(chunks.iter().map(|c| c.last_ts_ms).collect::<Vec<_>>())
    .execute(&mut **tx)
    .await?;
    Ok(())
}
