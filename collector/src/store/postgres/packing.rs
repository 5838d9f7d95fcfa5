//! Moving cold raw GPU samples into packed chunks and back.
//!
//! - Maintenance packs each day partition of `gpu_samples` once the day
//!   ended `pack_raw_after_hours` ago and its minutes are rolled up: device
//!   by device, one transaction each (delete the raw rows, insert their
//!   chunks), then empties the partition with `TRUNCATE`, which also gives
//!   its index back.
//! - A sample that arrives after its day was packed lands in the raw
//!   partition as usual and marks its minute. Before that minute is rolled
//!   up again, the chunks of the devices with such samples are unpacked
//!   back into raw rows, so that the rollup reads the whole minute; the
//!   next packing pass packs them again.
//! - Charts read chunks next to raw rows ([`samples_between`]).
//!
//! A raw row whose minute is still waiting for its rollup is never packed:
//! the rollup reads raw rows only.

use std::time::{Duration, Instant};

use sqlx::postgres::PgPool;
use sqlx::{Postgres, Row, Transaction};

use super::maintenance::{Partition, ensure_partitions, raw_partitions};
use super::packed::{self, GpuChunk};
use super::write::copy_gpu_samples;
use crate::model::GpuSampleRow;
use crate::store::StoreError;
use crate::store::rollup::{HOUR_MS, MINUTE_MS, StorageConfig, bucket_start};

/// Time one maintenance pass spends packing before it lets the rollups run
/// again; a large day is packed over several passes.
const PASS_BUDGET: Duration = Duration::from_secs(10);

const RAW_COLUMNS: &str =
    "device_id, ts_ms, interval_ms, poll_count, used_last, used_min, used_max,
    reserved, total, utilization, pcie_tx, pcie_rx";

/// Where raw GPU samples are packed up to (exclusive).
pub(super) async fn packed_until(pool: &PgPool) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT COALESCE((SELECT packed_until_ms FROM pack_progress WHERE parent = 'gpu_samples'), 0)",
    )
    .fetch_one(pool)
    .await?)
}

/// Packs every day that is old enough and rolled up, oldest first, for at
/// most [`PASS_BUDGET`]. Returns how many samples it packed.
pub(super) async fn pack_cold_days(
    pool: &PgPool,
    storage: &StorageConfig,
    now_ms: i64,
    minute_watermark_ms: i64,
) -> Result<u64, StoreError> {
    let Some(pack_after_ms) = storage.pack_raw_after_ms() else {
        return Ok(0);
    };
    let cutoff = (now_ms - pack_after_ms).min(minute_watermark_ms);
    let started = Instant::now();
    let mut packed = 0;
    let mut days: Vec<Partition> = raw_partitions(pool, "gpu_samples")
        .await?
        .into_iter()
        .filter(|p| p.to_ms <= cutoff)
        .collect();
    days.sort_by_key(|p| p.from_ms);
    for day in days {
        if started.elapsed() > PASS_BUDGET {
            break;
        }
        // Marks the day before moving anything, so that a rollup of one of
        // its minutes knows to unpack first.
        sqlx::query(
            "UPDATE pack_progress SET packed_until_ms = GREATEST(packed_until_ms, $1)
             WHERE parent = 'gpu_samples'",
        )
        .bind(day.to_ms)
        .execute(pool)
        .await?;
        if partition_bytes(pool, &day.name).await? == 0 {
            continue;
        }
        ensure_partitions(pool, day.from_ms, day.to_ms - 1).await?;
        let (samples, done) = pack_day(pool, &day, started).await?;
        packed += samples;
        if done {
            empty_partition(pool, &day.name).await?;
        }
    }
    Ok(packed)
}

async fn partition_bytes(pool: &PgPool, name: &str) -> Result<i64, StoreError> {
    Ok(
        sqlx::query_scalar("SELECT pg_relation_size(to_regclass($1))::int8")
            .bind(quote_ident(name))
            .fetch_one(pool)
            .await?,
    )
}

/// Packs one day partition device by device. Returns the samples packed
/// and whether every device was done within the budget.
async fn pack_day(
    pool: &PgPool,
    day: &Partition,
    started: Instant,
) -> Result<(u64, bool), StoreError> {
    let table = quote_ident(&day.name);
    // Distinct devices by skipping through the (device_id, ts_ms) index,
    // not by reading every row.
    let devices: Vec<i32> = sqlx::query_scalar(&format!(
        "WITH RECURSIVE d AS (
             SELECT min(device_id) AS id FROM {table}
             UNION ALL
             SELECT (SELECT min(device_id) FROM {table} WHERE device_id > d.id) FROM d WHERE d.id IS NOT NULL)
         SELECT id FROM d WHERE id IS NOT NULL"
    ))
    .fetch_all(pool)
    .await?;
    let mut packed = 0;
    for device in devices {
        if started.elapsed() > PASS_BUDGET {
            return Ok((packed, false));
        }
        packed += pack_device(pool, day, &table, device).await?;
    }
    Ok((packed, true))
}

async fn pack_device(
    pool: &PgPool,
    day: &Partition,
    table: &str,
    device: i32,
) -> Result<u64, StoreError> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query(&format!(
        "DELETE FROM {table} WHERE device_id = $1 RETURNING {RAW_COLUMNS}"
    ))
    .bind(device)
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(raw_row)
    .collect::<Result<Vec<_>, _>>()?;
    // Rows of a minute that waits for its rollup go back: the rollup reads
    // raw rows. Marks are read after the delete, so a late row it took is
    // seen with its mark (both committed together).
    let pending: Vec<i64> = sqlx::query_scalar(
        "SELECT bucket_ms FROM rollup_pending WHERE step_ms = $1 AND bucket_ms >= $2 AND bucket_ms < $3
         ORDER BY bucket_ms",
    )
    .bind(MINUTE_MS)
    .bind(day.from_ms)
    .bind(day.to_ms)
    .fetch_all(&mut *tx)
    .await?;
    let (waiting, cold): (Vec<GpuSampleRow>, Vec<GpuSampleRow>) = rows.into_iter().partition(|r| {
        pending
            .binary_search(&bucket_start(r.timestamp_ms, MINUTE_MS))
            .is_ok()
    });
    copy_gpu_samples(&mut tx, waiting.iter()).await?;
    let samples = cold.len() as u64;
    let chunks = packed::chunks_by_hour(i64::from(device), cold).map_err(|e| {
        StoreError::Damaged(format!("packing device {device} of {}: {e}", day.name))
    })?;
    insert_chunks(&mut tx, &chunks).await?;
    tx.commit().await?;
    Ok(samples)
}

/// Empties a packed day partition, so that its heap and index go back to
/// the file system. Only when no row is left, under a lock that keeps a
/// late writer out meanwhile; otherwise the next pass tries again.
async fn empty_partition(pool: &PgPool, name: &str) -> Result<(), StoreError> {
    let table = quote_ident(name);
    // Dead rows gone first, so that the check below reads a few pages.
    sqlx::query(&format!("VACUUM {table}"))
        .execute(pool)
        .await?;
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL lock_timeout = '5s'")
        .execute(&mut *tx)
        .await?;
    sqlx::query(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *tx)
        .await?;
    let left: bool = sqlx::query_scalar(&format!("SELECT EXISTS (SELECT 1 FROM {table})"))
        .fetch_one(&mut *tx)
        .await?;
    if !left {
        sqlx::query(&format!("TRUNCATE {table}"))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    if !left {
        tracing::info!(partition = %name, "packed a day of raw GPU samples");
    }
    Ok(())
}

async fn insert_chunks(
    tx: &mut Transaction<'_, Postgres>,
    chunks: &[GpuChunk],
) -> Result<(), StoreError> {
    if chunks.is_empty() {
        return Ok(());
    }
    let device = chunks
        .iter()
        .map(|c| i32::try_from(c.device_id))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| StoreError::Invalid("device id out of range".into()))?;
    sqlx::query(
        "INSERT INTO gpu_samples_packed (device_id, hour_ms, first_ts_ms, last_ts_ms, samples, data)
         SELECT * FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int4[], $6::bytea[])",
    )
    .bind(device)
    .bind(chunks.iter().map(|c| c.hour_ms).collect::<Vec<_>>())
    .bind(chunks.iter().map(|c| c.first_ts_ms).collect::<Vec<_>>())
    .bind(chunks.iter().map(|c| c.last_ts_ms).collect::<Vec<_>>())
    .bind(chunks.iter().map(|c| c.samples).collect::<Vec<_>>())
    .bind(chunks.iter().map(|c| c.data.as_slice()).collect::<Vec<_>>())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Before minutes `[from_ms, to_ms)` of a packed day are rolled up again:
/// unpacks the chunks of every device with raw rows in them (samples that
/// arrived late), so that the rollup reads their whole minutes. Returns how
/// many samples it unpacked.
pub(super) async fn unpack_for_rollup(
    tx: &mut Transaction<'_, Postgres>,
    from_ms: i64,
    to_ms: i64,
) -> Result<u64, StoreError> {
    let chunks = sqlx::query(
        "DELETE FROM gpu_samples_packed
         WHERE hour_ms >= $3 AND hour_ms < $2 AND last_ts_ms >= $1 AND first_ts_ms < $2
           AND device_id IN (SELECT DISTINCT device_id FROM gpu_samples WHERE ts_ms >= $1 AND ts_ms < $2)
         RETURNING device_id, hour_ms, first_ts_ms, last_ts_ms, samples, data",
    )
    .bind(from_ms)
    .bind(to_ms)
    .bind(bucket_start(from_ms, HOUR_MS))
    .fetch_all(&mut **tx)
    .await?;
    let mut rows = Vec::new();
    let mut damaged = Vec::new();
    for chunk in &chunks {
        let chunk = chunk_row(chunk)?;
        match packed::decode(chunk.device_id, &chunk.data) {
            Ok(decoded) => rows.extend(decoded),
            Err(error) => {
                tracing::error!(device = chunk.device_id, hour_ms = chunk.hour_ms, %error,
                    "a packed chunk of GPU samples is damaged; left as it is, out of the rollup");
                damaged.push(chunk);
            }
        }
    }
    insert_chunks(tx, &damaged).await?;
    copy_gpu_samples(tx, rows.iter()).await?;
    Ok(rows.len() as u64)
}

/// One device's packed samples with timestamps in `[from_ms, to_ms]`, in
/// time order. A damaged chunk is logged and left out, not an error: the
/// rest of the chart still stands.
pub(super) async fn samples_between(
    pool: &PgPool,
    device: i32,
    from_ms: i64,
    to_ms: i64,
) -> Result<Vec<GpuSampleRow>, StoreError> {
    let chunks = sqlx::query(
        "SELECT device_id, hour_ms, first_ts_ms, last_ts_ms, samples, data FROM gpu_samples_packed
         WHERE device_id = $1 AND hour_ms >= $2 AND hour_ms <= $3 AND last_ts_ms >= $4 AND first_ts_ms <= $3",
    )
    .bind(device)
    .bind(bucket_start(from_ms, HOUR_MS))
    .bind(to_ms)
    .bind(from_ms)
    .fetch_all(pool)
    .await?;
    let mut rows = Vec::new();
    for chunk in &chunks {
        let chunk = chunk_row(chunk)?;
        match packed::decode(chunk.device_id, &chunk.data) {
            Ok(decoded) => rows.extend(
                decoded
                    .into_iter()
                    .filter(|r| (from_ms..=to_ms).contains(&r.timestamp_ms)),
            ),
            Err(error) => tracing::error!(device, hour_ms = chunk.hour_ms, %error,
                "a packed chunk of GPU samples is damaged; left out of the chart"),
        }
    }
    rows.sort_unstable_by_key(|r| r.timestamp_ms);
    Ok(rows)
}

fn chunk_row(row: &sqlx::postgres::PgRow) -> Result<GpuChunk, sqlx::Error> {
    Ok(GpuChunk {
        device_id: i64::from(row.try_get::<i32, _>("device_id")?),
        hour_ms: row.try_get("hour_ms")?,
        first_ts_ms: row.try_get("first_ts_ms")?,
        last_ts_ms: row.try_get("last_ts_ms")?,
        samples: row.try_get("samples")?,
        data: row.try_get("data")?,
    })
}

fn raw_row(row: &sqlx::postgres::PgRow) -> Result<GpuSampleRow, sqlx::Error> {
    Ok(GpuSampleRow {
        device_id: i64::from(row.try_get::<i32, _>("device_id")?),
        timestamp_ms: row.try_get("ts_ms")?,
        interval_ms: row.try_get("interval_ms")?,
        poll_count: row.try_get("poll_count")?,
        used_last: row.try_get("used_last")?,
        used_min: row.try_get("used_min")?,
        used_max: row.try_get("used_max")?,
        reserved: row.try_get("reserved")?,
        total: row.try_get("total")?,
        utilization_pct: row.try_get("utilization")?,
        pcie_tx_bytes_per_s: row.try_get("pcie_tx")?,
        pcie_rx_bytes_per_s: row.try_get("pcie_rx")?,
    })
}

/// A partition name as an SQL identifier. Names come from `pg_class`, but
/// quoting keeps any name safe.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
