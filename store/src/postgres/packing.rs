//! Moving cold raw samples (GPU and process) into packed chunks and back.
//!
//! - Maintenance packs each day partition of a raw table once the day ended
//!   `pack_raw_after_hours` ago and its minutes are rolled up: a few series
//!   at a time, one transaction each (delete the raw rows, insert their
//!   chunks), then empties the partition with `TRUNCATE`, which also gives
//!   its indexes back.
//! - A sample that arrives after its day was packed lands in the raw
//!   partition as usual and marks its minute. Before that minute is rolled
//!   up again, the chunks of the series with such samples are unpacked back
//!   into raw rows, so that the rollup reads whole minutes; the next
//!   packing pass packs them again.
//! - Charts read chunks next to raw rows ([`samples_between`]).
//!
//! A raw row whose minute is still waiting for its rollup is never packed:
//! the rollup reads raw rows only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::{Postgres, Row, Transaction};

use super::copy::{BinaryRows, copy_in};
use super::maintenance::{PACKING_LOCK, Partition, partitions_of};
use super::write::{GPU_SAMPLES_COPY, PROCESS_SAMPLES_COPY, gpu_sample_rows, process_sample_rows};
use crate::StoreError;
use crate::chart_fold::AllocatorFold;
use crate::chunk_format::{self as packed, Chunk, ChunkTable};
use crate::model::{GpuSampleRow, ProcessPoint};
use crate::rollup::{HOUR_MS, MINUTE_MS, StorageConfig, bucket_start};

/// A raw sample table whose cold days are packed (its series column named
/// as in its chunk table).
pub(super) trait PackedTable: ChunkTable {
    /// The raw table, as named in `pack_progress`.
    const RAW: &'static str;
    /// What `DELETE … RETURNING` gives [`PackedTable::from_row`].
    const COLUMNS: &'static str;
    const COPY: &'static str;
    /// Series packed per transaction: about a day of 1 Hz samples each.
    const SERIES_PER_TRANSACTION: usize;
    fn series(&self) -> i64;
    fn from_row(row: &PgRow) -> Result<Self, sqlx::Error>;
    fn copy_rows(rows: &[Self]) -> Result<BinaryRows, StoreError>;
}

impl PackedTable for GpuSampleRow {
    const RAW: &'static str = "gpu_samples";
    const COLUMNS: &'static str = "device_id, ts_ms, interval_ms, poll_count, used_last,
        used_min, used_max, reserved, total, utilization, pcie_tx, pcie_rx";
    const COPY: &'static str = GPU_SAMPLES_COPY;
    const SERIES_PER_TRANSACTION: usize = 1;

    fn series(&self) -> i64 {
        self.device_id
    }

    fn from_row(row: &PgRow) -> Result<Self, sqlx::Error> {
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

    fn copy_rows(rows: &[Self]) -> Result<BinaryRows, StoreError> {
        gpu_sample_rows(rows.iter())
    }
}

impl PackedTable for ProcessPoint {
    const RAW: &'static str = "process_samples";
    const COLUMNS: &'static str = "process_id, ts_ms, used_last, used_max";
    const COPY: &'static str = PROCESS_SAMPLES_COPY;
    const SERIES_PER_TRANSACTION: usize = 8;

    fn series(&self) -> i64 {
        self.process_id
    }

    fn from_row(row: &PgRow) -> Result<Self, sqlx::Error> {
        Ok(ProcessPoint {
            process_id: row.try_get("process_id")?,
            timestamp_ms: row.try_get("ts_ms")?,
            used_last: row.try_get("used_last")?,
            used_max: row.try_get("used_max")?,
        })
    }

    fn copy_rows(rows: &[Self]) -> Result<BinaryRows, StoreError> {
        Ok(process_sample_rows(rows.iter().map(|r| {
            (r.process_id, r.timestamp_ms, r.used_last, r.used_max)
        })))
    }
}

/// Where the raw samples of `T` are packed up to (exclusive).
pub(super) async fn packed_until<T: PackedTable>(
    conn: &mut PgConnection,
) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT COALESCE((SELECT packed_until_ms FROM pack_progress WHERE parent = $1), 0)",
    )
    .bind(T::RAW)
    .fetch_one(conn)
    .await?)
}

/// Orders this transaction against packing ones (and minute rollups): one
/// leader runs both in turn, but two may overlap for a pass when the
/// first loses its lock's connection.
pub(super) async fn lock_against_packing(conn: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(PACKING_LOCK)
        .execute(conn)
        .await?;
    Ok(())
}

/// Packs every day that is old enough and rolled up, oldest first: GPU
/// samples for half of the pass's packing time, then process samples, each
/// at least one transaction. Returns how many samples it packed. A table
/// that fails is logged and left for the next pass; the other still gets
/// its turn.
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
    let pass = storage.pack_time_per_pass();
    let gpu = Budget::until(started + pass / 2);
    let process = Budget::until(started + pass);
    let mut packed = 0;
    match pack_table::<GpuSampleRow>(pool, cutoff, &gpu).await {
        Ok(n) => packed += n,
        Err(error) => tracing::warn!(%error, "packing GPU samples failed; next pass retries"),
    }
    match pack_table::<ProcessPoint>(pool, cutoff, &process).await {
        Ok(n) => packed += n,
        Err(error) => tracing::warn!(%error, "packing process samples failed; next pass retries"),
    }
    Ok(packed)
}

/// A table's share of the pass: it ends at a deadline, but only once the
/// table packed something, so that every pass makes progress however short
/// its share.
struct Budget {
    deadline: Instant,
    used: AtomicBool,
}

impl Budget {
    fn until(deadline: Instant) -> Self {
        Self {
            deadline,
            used: AtomicBool::new(false),
        }
    }

    fn record_use(&self) {
        self.used.store(true, Ordering::Relaxed);
    }

    fn spent(&self) -> bool {
        self.used.load(Ordering::Relaxed) && Instant::now() > self.deadline
    }
}

async fn pack_table<T: PackedTable>(
    pool: &PgPool,
    cutoff: i64,
    budget: &Budget,
) -> Result<u64, StoreError> {
    // The chunk partitions these days need exist: the pass made every
    // partition of the raw retention window before it came here.
    let mut days: Vec<Partition> = partitions_of(pool, &[T::RAW])
        .await?
        .into_iter()
        .filter(|p| p.to_ms <= cutoff)
        .collect();
    days.sort_by_key(|p| p.from_ms);
    // Cursors of days retention has dropped since.
    sqlx::query("DELETE FROM pack_cursors WHERE parent = $1 AND day_ms < $2")
        .bind(T::RAW)
        .bind(days.first().map_or(cutoff, |d| d.from_ms))
        .execute(pool)
        .await?;
    let mut packed = 0;
    for day in days {
        if budget.spent() {
            break;
        }
        // Marks the day before moving anything, so that a rollup of one of
        // its minutes knows to unpack first.
        sqlx::query(
            "UPDATE pack_progress SET packed_until_ms = GREATEST(packed_until_ms, $2)
             WHERE parent = $1",
        )
        .bind(T::RAW)
        .bind(day.to_ms)
        .execute(pool)
        .await?;
        let size = partition_size(pool, &day.name).await?;
        if size.heap_bytes == 0 && size.index_bytes <= EMPTY_INDEX_BYTES {
            continue; // emptied (or never written)
        }
        let (samples, done) = pack_day::<T>(pool, &day, budget).await?;
        packed += samples;
        if done {
            empty_partition::<T>(pool, &day).await?;
            // Emptying is work too (a VACUUM, a lock wait): a pass that
            // finds only days to empty, say while a long reader keeps one
            // locked, still ends on time.
            budget.record_use();
        }
    }
    Ok(packed)
}

/// Indexes of an emptied day partition (B-tree metapage, BRIN pages) fit
/// in this; more means rows, or an emptied heap whose indexes still hold
/// the dead entries.
const EMPTY_INDEX_BYTES: i64 = 64 << 10;

/// Dead rows up to which a pass vacuums a packed partition itself: a
/// second or so. More waits for autovacuum (if it runs), which throttles
/// itself, rather than hold up the rollups for minutes; after it, few are
/// left.
const VACUUM_IN_PASS_DEAD_ROWS: i64 = 1_000_000;

#[derive(Debug, sqlx::FromRow)]
struct PartitionSize {
    heap_bytes: i64,
    index_bytes: i64,
    dead_rows: i64,
    /// Whether autovacuum runs at all: where it is off, the pass vacuums
    /// however many dead rows there are.
    autovacuum: bool,
}

async fn partition_size(pool: &PgPool, name: &str) -> Result<PartitionSize, StoreError> {
    Ok(sqlx::query_as(
        "SELECT COALESCE(pg_relation_size(c.oid), 0)::int8 AS heap_bytes,
                COALESCE(pg_indexes_size(c.oid), 0)::int8 AS index_bytes,
                COALESCE(pg_stat_get_dead_tuples(c.oid), 0)::int8 AS dead_rows,
                current_setting('autovacuum')::bool AND current_setting('track_counts')::bool
                    AS autovacuum
         FROM (SELECT to_regclass($1) AS oid) c",
    )
    .bind(quote_ident(name))
    .fetch_one(pool)
    .await?)
}

/// Packs one day partition a few series at a time, from where an earlier
/// pass left off. Returns the samples packed and whether every series was
/// done within the budget.
async fn pack_day<T: PackedTable>(
    pool: &PgPool,
    day: &Partition,
    budget: &Budget,
) -> Result<(u64, bool), StoreError> {
    let table = quote_ident(&day.name);
    let key = T::KEY;
    let after: Option<i64> = sqlx::query_scalar(
        "SELECT last_series FROM pack_cursors WHERE parent = $1 AND day_ms = $2",
    )
    .bind(T::RAW)
    .bind(day.from_ms)
    .fetch_optional(pool)
    .await?;
    // Distinct series by skipping through the (series, ts_ms) index, not by
    // reading every row, and not through the dead entries of the series
    // packed before.
    let series: Vec<i64> = sqlx::query_scalar(&format!(
        "WITH RECURSIVE s AS (
             SELECT min({key}) AS id FROM {table} WHERE {key} > $1
             UNION ALL
             SELECT (SELECT min({key}) FROM {table} WHERE {key} > s.id) FROM s WHERE s.id IS NOT NULL)
         SELECT id::int8 FROM s WHERE id IS NOT NULL"
    ))
    .bind(after.unwrap_or(i64::MIN))
    .fetch_all(pool)
    .await?;
    let mut packed = 0;
    for some in series.chunks(T::SERIES_PER_TRANSACTION) {
        if budget.spent() {
            return Ok((packed, false));
        }
        packed += pack_series::<T>(pool, day, &table, some).await?;
        budget.record_use();
    }
    // Walked to the end: later passes find nothing after the cursor until
    // emptying the partition resets it (rows were left) or empties it.
    set_cursor::<T>(pool, day, i64::MAX).await?;
    Ok((packed, true))
}

async fn pack_series<T: PackedTable>(
    pool: &PgPool,
    day: &Partition,
    table: &str,
    series: &[i64],
) -> Result<u64, StoreError> {
    let mut tx = pool.begin().await?;
    lock_against_packing(&mut tx).await?;
    let rows = sqlx::query(&format!(
        "DELETE FROM {table} WHERE {} = ANY($1) RETURNING {}",
        T::KEY,
        T::COLUMNS
    ))
    .bind(series)
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(T::from_row)
    .collect::<Result<Vec<T>, _>>()?;
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
    let (waiting, cold): (Vec<T>, Vec<T>) = rows.into_iter().partition(|r| {
        pending
            .binary_search(&bucket_start(r.timestamp_ms(), MINUTE_MS))
            .is_ok()
    });
    copy_in(&mut tx, T::COPY, T::copy_rows(&waiting)?).await?;
    let samples = cold.len() as u64;
    insert_chunks::<T>(&mut tx, &pack_rows(cold, &day.name)?).await?;
    let last = series.iter().copied().max().unwrap_or(i64::MIN);
    set_cursor::<T>(&mut *tx, day, last).await?;
    tx.commit().await?;
    Ok(samples)
}

/// Records that `day` is packed up to series `key`.
async fn set_cursor<'c, T: PackedTable>(
    conn: impl sqlx::PgExecutor<'c>,
    day: &Partition,
    key: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO pack_cursors (parent, day_ms, last_series) VALUES ($1, $2, $3)
         ON CONFLICT (parent, day_ms) DO UPDATE SET last_series = EXCLUDED.last_series",
    )
    .bind(T::RAW)
    .bind(day.from_ms)
    .bind(key)
    .execute(conn)
    .await?;
    Ok(())
}

/// Forgets how far `day` was walked, so that the next pass walks it from
/// the start.
async fn reset_cursor<T: PackedTable>(pool: &PgPool, day: &Partition) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM pack_cursors WHERE parent = $1 AND day_ms = $2")
        .bind(T::RAW)
        .bind(day.from_ms)
        .execute(pool)
        .await?;
    Ok(())
}

/// Rows of any series into their chunks.
fn pack_rows<T: PackedTable>(rows: Vec<T>, whence: &str) -> Result<Vec<Chunk>, StoreError> {
    let mut chunks = Vec::new();
    for (key, rows) in by_series(rows) {
        chunks.extend(packed::chunks_by_hour(key, rows).map_err(|e| {
            StoreError::Damaged(format!("packing {} {key} of {whence}: {e}", T::KEY))
        })?);
    }
    Ok(chunks)
}

fn by_series<T: PackedTable>(mut rows: Vec<T>) -> Vec<(i64, Vec<T>)> {
    rows.sort_by_key(|r| (r.series(), r.timestamp_ms()));
    let mut groups: Vec<(i64, Vec<T>)> = Vec::new();
    for row in rows {
        match groups.last_mut() {
            Some((key, group)) if *key == row.series() => group.push(row),
            _ => groups.push((row.series(), vec![row])),
        }
    }
    groups
}

/// Empties a walked day partition, so that its heap and indexes go back to
/// the file system: vacuums it (unless autovacuum is better placed to),
/// then, under a lock that keeps a late writer out, truncates it if no row
/// is left. Rows left (put back for a pending rollup, or late) reset the
/// walk; a lock not to be had within 5 s waits for the next pass.
async fn empty_partition<T: PackedTable>(pool: &PgPool, day: &Partition) -> Result<(), StoreError> {
    let table = quote_ident(&day.name);
    let size = partition_size(pool, &day.name).await?;
    if size.dead_rows > VACUUM_IN_PASS_DEAD_ROWS && size.autovacuum {
        tracing::debug!(partition = %day.name, dead_rows = size.dead_rows,
            "packed; autovacuum clears the dead rows before the partition is emptied");
        return Ok(());
    }
    // Dead rows gone first, so that the check below reads a few pages.
    sqlx::query(&format!("VACUUM {table}"))
        .execute(pool)
        .await?;
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL lock_timeout = '5s'")
        .execute(&mut *tx)
        .await?;
    let locked = sqlx::query(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *tx)
        .await;
    match locked {
        Ok(_) => {}
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            tracing::info!(partition = %day.name, "packed partition busy; emptying it next pass");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    }
    let left: bool = sqlx::query_scalar(&format!("SELECT EXISTS (SELECT 1 FROM {table})"))
        .fetch_one(&mut *tx)
        .await?;
    if !left {
        sqlx::query(&format!("TRUNCATE {table}"))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    reset_cursor::<T>(pool, day).await?;
    if !left {
        tracing::info!(partition = %day.name, "packed a day of raw samples");
    }
    Ok(())
}

/// SQLSTATE of a lock wait that ran into `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

pub(super) async fn insert_chunks<T: ChunkTable>(
    tx: &mut Transaction<'_, Postgres>,
    chunks: &[Chunk],
) -> Result<(), StoreError> {
    if chunks.is_empty() {
        return Ok(());
    }
    let (minutes_column, minutes_array) = if T::MINUTES {
        (", minutes", ", $7::bytea[]")
    } else {
        ("", "")
    };
    let sql = format!(
        "INSERT INTO {} ({}, hour_ms, first_ts_ms, last_ts_ms, samples, data{minutes_column})
         SELECT * FROM UNNEST($1::int8[], $2::int8[], $3::int8[], $4::int8[], $5::int4[], $6::bytea[]{minutes_array})",
        T::TABLE,
        T::KEY
    );
    let insert = sqlx::query(&sql)
        .bind(chunks.iter().map(|c| c.key).collect::<Vec<_>>())
        .bind(chunks.iter().map(|c| c.hour_ms).collect::<Vec<_>>())
        .bind(chunks.iter().map(|c| c.first_ts_ms).collect::<Vec<_>>())
        .bind(chunks.iter().map(|c| c.last_ts_ms).collect::<Vec<_>>())
        .bind(chunks.iter().map(|c| c.samples).collect::<Vec<_>>())
        .bind(chunks.iter().map(|c| c.data.as_slice()).collect::<Vec<_>>());
    let insert = if T::MINUTES {
        insert.bind(
            chunks
                .iter()
                .map(|c| c.minutes.as_deref())
                .collect::<Vec<_>>(),
        )
    } else {
        insert
    };
    insert.execute(&mut **tx).await?;
    Ok(())
}

/// Rows copied back per `COPY` while unpacking: bounds the memory a long
/// replay's unpacking takes.
const UNPACK_COPY_ROWS: usize = 100_000;

/// Before minutes `[from_ms, to_ms)` of a packed day are rolled up again:
/// unpacks the chunks of every series and hour with raw rows in them
/// (samples that arrived late), so that the rollup reads whole minutes.
/// Where such a chunk is damaged, the late rows of its series and hour are
/// packed aside instead: the rollup then leaves that series' minutes as
/// they were rather than recompute them from the late rows alone. Returns
/// how many samples it unpacked.
pub(super) async fn unpack_for_rollup<T: PackedTable>(
    tx: &mut Transaction<'_, Postgres>,
    from_ms: i64,
    to_ms: i64,
) -> Result<u64, StoreError> {
    let key = T::KEY;
    let chunks = sqlx::query(&format!(
        "WITH late AS (
             SELECT DISTINCT {key} AS series, ts_ms - ts_ms % $3 AS hour
             FROM {raw} WHERE ts_ms >= $1 AND ts_ms < $2)
         DELETE FROM {packed} p USING late
         WHERE p.{key} = late.series AND p.hour_ms = late.hour
           AND p.hour_ms >= $4 AND p.hour_ms < $2
         RETURNING p.{key}::int8 AS key, p.hour_ms, p.first_ts_ms, p.last_ts_ms, p.samples, p.data",
        packed = T::TABLE,
        raw = T::RAW,
    ))
    .bind(from_ms)
    .bind(to_ms)
    .bind(HOUR_MS)
    .bind(bucket_start(from_ms, HOUR_MS))
    .fetch_all(&mut **tx)
    .await?;
    let mut unpacked = 0;
    let mut rows: Vec<T> = Vec::new();
    let mut damaged = Vec::new();
    for chunk in &chunks {
        let chunk = chunk_row(chunk)?;
        match packed::decode_checked::<T>(&chunk) {
            Ok(decoded) => rows.extend(decoded),
            Err(error) => {
                tracing::error!(table = T::TABLE, series = chunk.key, hour_ms = chunk.hour_ms, %error,
                    "a packed chunk is damaged: kept as it is; its late samples stay out of the rollup");
                damaged.push(chunk);
            }
        }
        if rows.len() >= UNPACK_COPY_ROWS {
            unpacked += rows.len() as u64;
            copy_in(tx, T::COPY, T::copy_rows(&rows)?).await?;
            rows.clear();
        }
    }
    unpacked += rows.len() as u64;
    copy_in(tx, T::COPY, T::copy_rows(&rows)?).await?;
    for chunk in &damaged {
        let late = sqlx::query(&format!(
            "DELETE FROM {raw} WHERE {key} = $1 AND ts_ms >= $2 AND ts_ms < $3 RETURNING {columns}",
            raw = T::RAW,
            columns = T::COLUMNS,
        ))
        .bind(chunk.key)
        .bind(chunk.hour_ms.max(from_ms))
        .bind((chunk.hour_ms + HOUR_MS).min(to_ms))
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(T::from_row)
        .collect::<Result<Vec<T>, _>>()?;
        insert_chunks::<T>(tx, &pack_rows(late, T::RAW)?).await?;
    }
    insert_chunks::<T>(tx, &damaged).await?;
    Ok(unpacked)
}

/// The packed samples of `series` with timestamps in `[from_ms, to_ms]`,
/// read on `conn` (the chart's transaction, so that chunks and raw rows
/// come from one snapshot). A damaged chunk is logged and left out, not an
/// error: the rest of the chart still stands.
pub(super) async fn samples_between<T: ChunkTable>(
    conn: &mut PgConnection,
    series: &[i64],
    from_ms: i64,
    to_ms: i64,
) -> Result<Vec<T>, StoreError> {
    let mut rows = Vec::new();
    each_sample_between(conn, series, (from_ms, to_ms), |r| rows.push(r)).await?;
    Ok(rows)
}

/// [`samples_between`] handed to `each` a chunk at a time, so that a long
/// range is never in memory decoded all at once.
pub(super) async fn each_sample_between<T: ChunkTable>(
    conn: &mut PgConnection,
    series: &[i64],
    (from_ms, to_ms): (i64, i64),
    mut each: impl FnMut(T),
) -> Result<(), StoreError> {
    if series.is_empty() || from_ms > to_ms {
        return Ok(());
    }
    let chunks = sqlx::query(&format!(
        "SELECT {key}::int8 AS key, hour_ms, first_ts_ms, last_ts_ms, samples, data FROM {packed}
         WHERE {key} = ANY($1) AND hour_ms >= $2 AND hour_ms <= $3 AND last_ts_ms >= $4
           AND first_ts_ms <= $3",
        key = T::KEY,
        packed = T::TABLE,
    ))
    .bind(series)
    .bind(bucket_start(from_ms, HOUR_MS))
    .bind(to_ms)
    .bind(from_ms)
    .fetch_all(&mut *conn)
    .await?;
    let mut decoded = Vec::new();
    for chunk in &chunks {
        packed::extend_for_chart(&mut decoded, &chunk_row(chunk)?, T::TABLE, from_ms, to_ms);
        decoded.drain(..).for_each(&mut each);
    }
    Ok(())
}

/// The allocator chunks of process `process_id` in `[from_ms, to_ms]`
/// folded into `fold`, read on `conn` (the chart's transaction). Where
/// `by_minute` (the chart's buckets are a minute or wider), a chunk that
/// lies wholly in the range and keeps its minutes is read as those alone:
/// its reports are not fetched.
pub(super) async fn fold_allocator_chunks(
    conn: &mut PgConnection,
    process_id: i64,
    (from_ms, to_ms): (i64, i64),
    by_minute: bool,
    fold: &mut AllocatorFold,
) -> Result<(), StoreError> {
    if from_ms > to_ms {
        return Ok(());
    }
    let chunks = sqlx::query(
        "SELECT place::text AS at, process_id AS key, hour_ms, first_ts_ms, last_ts_ms, samples,
             CASE WHEN whole THEN NULL ELSE data END AS data, CASE WHEN whole THEN minutes END AS minutes
         FROM (SELECT ctid AS place, *, $5 AND minutes IS NOT NULL AND first_ts_ms >= $4 AND last_ts_ms <= $3 AS whole
               FROM allocator_samples_packed
               WHERE process_id = $1 AND hour_ms >= $2 AND hour_ms <= $3 AND last_ts_ms >= $4
                 AND first_ts_ms <= $3) c",
    )
    .bind(process_id)
    .bind(bucket_start(from_ms, HOUR_MS))
    .bind(to_ms)
    .bind(from_ms)
    .bind(by_minute)
    .fetch_all(&mut *conn)
    .await?;
    for row in &chunks {
        let chunk = Chunk {
            data: row
                .try_get::<Option<Vec<u8>>, _>("data")?
                .unwrap_or_default(),
            minutes: row.try_get("minutes")?,
            ..chunk_header(row)?
        };
        if packed::fold_allocator_chunk(fold, &chunk, from_ms, to_ms) {
            continue;
        }
        // Its minutes are damaged: its reports, then. The row by its place
        // in its hour's partition, in the chart's snapshot: several chunks
        // of a series can share an hour and a span.
        let at: String = row.try_get("at")?;
        let Some(data) = sqlx::query_scalar::<_, Vec<u8>>(
            "SELECT data FROM allocator_samples_packed
             WHERE process_id = $1 AND hour_ms = $2 AND ctid = $3::tid",
        )
        .bind(chunk.key)
        .bind(chunk.hour_ms)
        .bind(at)
        .fetch_optional(&mut *conn)
        .await?
        else {
            continue;
        };
        let whole = Chunk {
            data,
            minutes: None,
            ..chunk
        };
        packed::fold_allocator_chunk(fold, &whole, from_ms, to_ms);
    }
    Ok(())
}

/// A chunk's row but its bytes.
fn chunk_header(row: &PgRow) -> Result<Chunk, sqlx::Error> {
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

pub(super) fn chunk_row(row: &PgRow) -> Result<Chunk, sqlx::Error> {
    Ok(Chunk {
        data: row.try_get("data")?,
        ..chunk_header(row)?
    })
}

/// A partition name as an SQL identifier. Names come from `pg_class`, but
/// quoting keeps any name safe.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
