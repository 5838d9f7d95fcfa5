//! The chunk: one series' samples (a GPU, a process) of one hour at most,
//! compressed to a few bytes each. Both stores write them: at each flush of
//! the open chunks (store/src/open_chunks.rs), and on Postgres also when
//! maintenance packs raw rows written before chunks were
//! (store/postgres/packing.rs). Queries decode them on the way out. A raw
//! GPU row costs about 140 bytes on disk (tuple header, ten 8-byte
//! columns, index entries), a process row about 90.
//!
//! A chunk is columnar: each column's values in time order (the spread of
//! min and max around the last value rather than min and max), each
//! written in the way that takes it fewest bytes (store/src/chunk_columns.rs),
//! then zstd over the lot where that helps. Steady columns shrink to almost
//! nothing; noisy ones keep about their entropy.

use crate::chart_fold::{self, AllocatorFold};
use crate::chunk_columns::{ColumnFormat, ColumnWriter, Reader, put_varint};
pub(crate) use crate::model::ProcessPoint;
use crate::model::{AllocatorReport, GpuSampleRow};
use crate::rollup::{HOUR_MS, MINUTE_MS, bucket_start};
use crate::views::AllocatorPoint;

/// Samples in one chunk at most: an hour at 10 Hz is 36,000. A larger count
/// is a damaged chunk, not a long hour.
const MAX_SAMPLES: u64 = 1 << 20;
/// Encoded bytes per sample at most: fourteen varints of ten bytes (eleven
/// columns, three of them with a flag).
const MAX_SAMPLE_BYTES: u64 = 14 * 10;
/// The fourteen columns' own headers at most (format 2: mode, first values,
/// divisor, packing).
const MAX_HEADER_BYTES: u64 = 14 * 64;
/// Format 2's byte after the format: how the columns' bytes follow.
const STORED: u8 = 0;
const ZSTD: u8 = 1;
const ZSTD_LEVEL: i32 = 3;
/// A chunk keeps its minutes (where its kind does) from this many on, and
/// where they are at most a quarter of its samples: a flush's chunk (a
/// minute at most, so two minutes at most) decodes in microseconds, and
/// its minutes would cost more bytes than they save time.
const MINUTES_KEPT_FROM: usize = 3;

/// A chunk that cannot be read back. Chunks are only written by this
/// module, so each of these means damage on disk or a newer format.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChunkError {
    #[error("unknown chunk format {0}")]
    Format(u8),
    #[error("chunk is empty")]
    Empty,
    #[error("chunk claims {0} samples")]
    TooLarge(u64),
    #[error("chunk does not decompress: {0}")]
    Compression(String),
    #[error("chunk ends inside its {0} column")]
    Truncated(&'static str),
    #[error("chunk's {0} column holds a value out of range")]
    OutOfRange(&'static str),
    #[error("chunk has {0} bytes after its last column")]
    Trailing(usize),
    #[error("chunk's samples do not match its row (count or hour)")]
    Mismatch,
}

/// A kind of stored sample that packs: its timestamp is the chunk's first
/// column; the rest are its own.
pub(crate) trait Packable: Sized {
    fn timestamp_ms(&self) -> i64;
    /// Every column but the timestamp, in time order.
    fn put_columns(rows: &[Self], out: &mut ColumnWriter);
    /// The samples of series `key` at `timestamps`, their other columns
    /// read from `r`.
    fn read_columns(
        key: i64,
        timestamps: Vec<i64>,
        r: &mut Reader<'_>,
    ) -> Result<Vec<Self>, ChunkError>;
    /// The chunk's samples folded a minute each, encoded, for charts whose
    /// buckets are a minute or wider: kinds without a rollup table of
    /// their own keep them (allocator reports). `None` where not kept.
    fn minutes(
        _compressor: &mut Compressor,
        _rows: &[Self],
    ) -> Result<Option<Vec<u8>>, ChunkError> {
        Ok(None)
    }
}

/// A kind of sample with a chunk table: its table and series column, the
/// same in both stores.
pub(crate) trait ChunkTable: Packable {
    const TABLE: &'static str;
    /// The series column.
    const KEY: &'static str;
    /// Whether the table has a `minutes` column for [`Packable::minutes`].
    const MINUTES: bool = false;
}

impl ChunkTable for GpuSampleRow {
    const TABLE: &'static str = "gpu_samples_packed";
    const KEY: &'static str = "device_id";
}

impl ChunkTable for ProcessPoint {
    const TABLE: &'static str = "process_samples_packed";
    const KEY: &'static str = "process_id";
}

/// Allocator reports have no raw table for Postgres to pack: before
/// chunks they were rows, which stay rows until retention drops them.
impl ChunkTable for AllocatorReport {
    const TABLE: &'static str = "allocator_samples_packed";
    const KEY: &'static str = "process_id";
    const MINUTES: bool = true;
}

/// One series' samples of one hour, ready for a `*_packed` table. The key
/// is the device id or the process id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub key: i64,
    pub hour_ms: i64,
    pub first_ts_ms: i64,
    pub last_ts_ms: i64,
    pub samples: i32,
    /// Empty where a chart read took the chunk's minutes instead.
    pub data: Vec<u8>,
    /// The samples folded a minute each ([`Packable::minutes`]).
    pub minutes: Option<Vec<u8>>,
}

impl Chunk {
    /// The bytes it puts on disk, before the database's own.
    pub(crate) fn bytes(&self) -> usize {
        self.data.len() + self.minutes.as_ref().map_or(0, Vec::len)
    }
}

/// Groups one series' samples (any order) into a chunk per hour.
pub(crate) fn chunks_by_hour<T: Packable>(
    key: i64,
    rows: Vec<T>,
) -> Result<Vec<Chunk>, ChunkError> {
    chunks_by_hour_with(&mut Compressor::new()?, key, rows)
}

/// A zstd context for many chunks: setting one up costs more than
/// compressing a minute of a series, which a flush does for every series.
pub(crate) struct Compressor(zstd::bulk::Compressor<'static>);

impl Compressor {
    pub(crate) fn new() -> Result<Self, ChunkError> {
        zstd::bulk::Compressor::new(ZSTD_LEVEL)
            .map(Self)
            .map_err(|e| ChunkError::Compression(e.to_string()))
    }
}

/// [`chunks_by_hour`] with a context of the caller's.
pub(crate) fn chunks_by_hour_with<T: Packable>(
    compressor: &mut Compressor,
    key: i64,
    mut rows: Vec<T>,
) -> Result<Vec<Chunk>, ChunkError> {
    rows.sort_unstable_by_key(T::timestamp_ms);
    let mut chunks = Vec::new();
    // An hour of more than MAX_SAMPLES samples (faster than 290 Hz) goes
    // into several chunks: one the decoder would refuse is never written.
    for hour in rows
        .chunk_by(|a, b| {
            bucket_start(a.timestamp_ms(), HOUR_MS) == bucket_start(b.timestamp_ms(), HOUR_MS)
        })
        .flat_map(|hour| hour.chunks(MAX_SAMPLES as usize))
    {
        let (Some(first), Some(last)) = (hour.first(), hour.last()) else {
            continue;
        };
        chunks.push(Chunk {
            key,
            hour_ms: bucket_start(first.timestamp_ms(), HOUR_MS),
            first_ts_ms: first.timestamp_ms(),
            last_ts_ms: last.timestamp_ms(),
            samples: i32::try_from(hour.len())
                .map_err(|_| ChunkError::TooLarge(hour.len() as u64))?,
            data: encode_with(compressor, hour)?,
            minutes: T::minutes(compressor, hour)?,
        });
    }
    Ok(chunks)
}

/// Packs samples, in time order, into a chunk.
#[cfg(test)]
pub(crate) fn encode<T: Packable>(rows: &[T]) -> Result<Vec<u8>, ChunkError> {
    encode_with(&mut Compressor::new()?, rows)
}

fn encode_with<T: Packable>(
    compressor: &mut Compressor,
    rows: &[T],
) -> Result<Vec<u8>, ChunkError> {
    encode_in(ColumnFormat::V2, compressor, rows)
}

/// Packs samples in `format`; only tests write format 1, to show that
/// chunks written before format 2 still read.
fn encode_in<T: Packable>(
    format: ColumnFormat,
    compressor: &mut Compressor,
    rows: &[T],
) -> Result<Vec<u8>, ChunkError> {
    let mut columns = ColumnWriter {
        format,
        out: Vec::with_capacity(rows.len() * 12 + 64),
    };
    put_varint(&mut columns.out, rows.len() as u64);
    columns.timestamps(rows.iter().map(T::timestamp_ms));
    T::put_columns(rows, &mut columns);
    let raw = columns.out;

    let packed = compressor
        .0
        .compress(&raw)
        .map_err(|e| ChunkError::Compression(e.to_string()))?;
    let mut chunk = vec![format as u8];
    put_varint(&mut chunk, raw.len() as u64);
    match format {
        ColumnFormat::V1 => chunk.extend_from_slice(&packed),
        // A minute of a noisy series is mostly bit-packed already: zstd's
        // frame would cost more than it finds.
        ColumnFormat::V2 if packed.len() < raw.len() => {
            chunk.push(ZSTD);
            chunk.extend_from_slice(&packed);
        }
        ColumnFormat::V2 => {
            chunk.push(STORED);
            chunk.extend_from_slice(&raw);
        }
    }
    Ok(chunk)
}

/// [`decode`], then checks the samples against what the chunk's row says
/// of them: bit rot that still decompresses is caught here.
pub(crate) fn decode_checked<T: Packable>(chunk: &Chunk) -> Result<Vec<T>, ChunkError> {
    let rows: Vec<T> = decode(chunk.key, &chunk.data)?;
    let hour = chunk.hour_ms..chunk.hour_ms.saturating_add(HOUR_MS);
    let in_range = |r: &T| {
        hour.contains(&r.timestamp_ms())
            && (chunk.first_ts_ms..=chunk.last_ts_ms).contains(&r.timestamp_ms())
    };
    if rows.len() != usize::try_from(chunk.samples).unwrap_or(usize::MAX)
        || !rows.iter().all(in_range)
    {
        return Err(ChunkError::Mismatch);
    }
    Ok(rows)
}

/// Adds the samples of `chunk` (a row of `table`) in `[from_ms, to_ms]` to
/// `rows`, for a chart; a chunk that does not decode is named in the log
/// and left out.
pub(crate) fn extend_for_chart<T: Packable>(
    rows: &mut Vec<T>,
    chunk: &Chunk,
    table: &str,
    from_ms: i64,
    to_ms: i64,
) {
    match decode_checked::<T>(chunk) {
        Ok(decoded) => rows.extend(
            decoded
                .into_iter()
                .filter(|r| (from_ms..=to_ms).contains(&r.timestamp_ms())),
        ),
        Err(error) => tracing::error!(table, series = chunk.key, hour_ms = chunk.hour_ms,
            %error, "a chunk is damaged; left out of the chart"),
    }
}

/// Folds an allocator chunk read for a chart into `fold`: its minutes
/// where the read took them (a chunk wholly inside a chart of minute-wide
/// buckets or wider), else its reports in `[from_ms, to_ms]`. `false`
/// where its minutes do not decode (named in the log): the caller reads
/// its reports instead. A chunk that does not decode is named in the log
/// and left out, as [`extend_for_chart`] leaves it.
pub(crate) fn fold_allocator_chunk(
    fold: &mut AllocatorFold,
    chunk: &Chunk,
    from_ms: i64,
    to_ms: i64,
) -> bool {
    if let Some(minutes) = &chunk.minutes {
        return match decode_minutes_checked(chunk, minutes) {
            Ok(points) => {
                points.into_iter().for_each(|p| fold.add_minute(p));
                true
            }
            Err(error) => {
                tracing::error!(table = AllocatorReport::TABLE, series = chunk.key,
                    hour_ms = chunk.hour_ms, %error,
                    "a chunk's minutes are damaged; the chart reads its reports");
                false
            }
        };
    }
    let mut reports = Vec::new();
    extend_for_chart(&mut reports, chunk, AllocatorReport::TABLE, from_ms, to_ms);
    reports.into_iter().for_each(|r| fold.add(r));
    true
}

/// A chunk's minutes, checked against its row: each within the chunk's
/// span, every report it holds counted once.
fn decode_minutes_checked(
    chunk: &Chunk,
    minutes: &[u8],
) -> Result<Vec<AllocatorPoint>, ChunkError> {
    let points: Vec<AllocatorPoint> = decode(chunk.key, minutes)?;
    let reports: i64 = points.iter().map(|p| p.reports).sum();
    let in_span = |p: &AllocatorPoint| {
        (chunk.first_ts_ms..=chunk.last_ts_ms).contains(&p.timestamp_ms) && p.reports > 0
    };
    if reports != i64::from(chunk.samples) || !points.iter().all(in_span) {
        return Err(ChunkError::Mismatch);
    }
    Ok(points)
}

/// What compacting a series' hour does: the indexes (into the chunks
/// given) of those it replaces, and what replaces them.
pub(crate) type Compacted = (Vec<usize>, Vec<Chunk>);

/// One series' chunks of one hour, compacted: the indexes (into `chunks`)
/// of those it replaces and the chunk that replaces them (several only past
/// `MAX_SAMPLES`). A timestamp held twice is kept once. A chunk that does
/// not decode is named in the log and left as it is, beside the new one;
/// `None` where fewer than two decode, so there is nothing to fold.
pub(crate) fn compact_series<T: Packable>(
    compressor: &mut Compressor,
    table: &str,
    chunks: &[&Chunk],
) -> Result<Option<Compacted>, ChunkError> {
    let mut samples: Vec<T> = Vec::new();
    let mut replaced = Vec::new();
    for (index, chunk) in chunks.iter().enumerate() {
        match decode_checked::<T>(chunk) {
            Ok(decoded) => {
                samples.extend(decoded);
                replaced.push(index);
            }
            Err(error) => tracing::error!(table, series = chunk.key, hour_ms = chunk.hour_ms,
                %error, "a chunk is damaged; left as it is beside its hour's compacted chunk"),
        }
    }
    if replaced.len() < 2 {
        return Ok(None);
    }
    samples.sort_by_key(T::timestamp_ms);
    samples.dedup_by_key(|s| s.timestamp_ms());
    let compacted = chunks_by_hour_with(compressor, chunks[replaced[0]].key, samples)?;
    Ok(Some((replaced, compacted)))
}

/// Reads a chunk back into the samples of series `key` it holds, in time
/// order.
pub(crate) fn decode<T: Packable>(key: i64, chunk: &[u8]) -> Result<Vec<T>, ChunkError> {
    let (&format_byte, rest) = chunk.split_first().ok_or(ChunkError::Empty)?;
    let format = match format_byte {
        1 => ColumnFormat::V1,
        2 => ColumnFormat::V2,
        other => return Err(ChunkError::Format(other)),
    };
    let mut header = Reader {
        format,
        bytes: rest,
    };
    let raw_len = header.varint("header")?;
    if raw_len > MAX_SAMPLES * MAX_SAMPLE_BYTES + MAX_HEADER_BYTES {
        return Err(ChunkError::TooLarge(raw_len));
    }
    let compressed = match format {
        ColumnFormat::V1 => true,
        ColumnFormat::V2 => {
            let (&how, body) = header
                .bytes
                .split_first()
                .ok_or(ChunkError::Truncated("header"))?;
            header.bytes = body;
            match how {
                ZSTD => true,
                STORED => false,
                _ => return Err(ChunkError::OutOfRange("header")),
            }
        }
    };
    let decompressed;
    let raw = if compressed {
        decompressed = zstd::bulk::decompress(header.bytes, raw_len as usize)
            .map_err(|e| ChunkError::Compression(e.to_string()))?;
        &decompressed[..]
    } else {
        header.bytes
    };
    if raw.len() as u64 != raw_len {
        return Err(ChunkError::Compression(format!(
            "{} bytes where the header says {raw_len}",
            raw.len()
        )));
    }
    let mut r = Reader { format, bytes: raw };
    let count = r.varint("count")?;
    if count > MAX_SAMPLES {
        return Err(ChunkError::TooLarge(count));
    }
    let timestamps = r.timestamps("timestamp", count as usize)?;
    let rows = T::read_columns(key, timestamps, &mut r)?;
    if !r.bytes.is_empty() {
        return Err(ChunkError::Trailing(r.bytes.len()));
    }
    Ok(rows)
}

impl Packable for GpuSampleRow {
    fn timestamp_ms(&self) -> i64 {
        self.timestamp_ms
    }

    fn put_columns(rows: &[Self], out: &mut ColumnWriter) {
        out.deltas(rows.iter().map(|r| i64::from(r.interval_ms)));
        out.deltas(rows.iter().map(|r| i64::from(r.poll_count)));
        out.deltas(rows.iter().map(|r| r.used_last));
        out.scaled(rows.iter().map(|r| r.used_last.wrapping_sub(r.used_min)));
        out.scaled(rows.iter().map(|r| r.used_max.wrapping_sub(r.used_last)));
        out.deltas(rows.iter().map(|r| r.reserved));
        out.deltas(rows.iter().map(|r| r.total));
        out.optional(rows.iter().map(|r| r.utilization_pct.map(i64::from)));
        out.optional(rows.iter().map(|r| r.pcie_tx_bytes_per_s));
        out.optional(rows.iter().map(|r| r.pcie_rx_bytes_per_s));
    }

    fn read_columns(
        key: i64,
        timestamps: Vec<i64>,
        r: &mut Reader<'_>,
    ) -> Result<Vec<Self>, ChunkError> {
        let n = timestamps.len();
        let mut rows: Vec<Self> = timestamps
            .into_iter()
            .map(|timestamp_ms| GpuSampleRow {
                device_id: key,
                timestamp_ms,
                ..GpuSampleRow::default()
            })
            .collect();
        for (row, v) in rows.iter_mut().zip(r.deltas("interval", n)?) {
            row.interval_ms = i32::try_from(v).map_err(|_| ChunkError::OutOfRange("interval"))?;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("poll count", n)?) {
            row.poll_count = i32::try_from(v).map_err(|_| ChunkError::OutOfRange("poll count"))?;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("used", n)?) {
            row.used_last = v;
        }
        for (row, v) in rows.iter_mut().zip(r.scaled("used min", n)?) {
            row.used_min = row.used_last.wrapping_sub(v);
        }
        for (row, v) in rows.iter_mut().zip(r.scaled("used max", n)?) {
            row.used_max = row.used_last.wrapping_add(v);
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("reserved", n)?) {
            row.reserved = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("total", n)?) {
            row.total = v;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("utilization", n)?) {
            row.utilization_pct = v
                .map(|v| i16::try_from(v).map_err(|_| ChunkError::OutOfRange("utilization")))
                .transpose()?;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("pcie tx", n)?) {
            row.pcie_tx_bytes_per_s = v;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("pcie rx", n)?) {
            row.pcie_rx_bytes_per_s = v;
        }
        Ok(rows)
    }
}

impl Packable for ProcessPoint {
    fn timestamp_ms(&self) -> i64 {
        self.timestamp_ms
    }

    fn put_columns(rows: &[Self], out: &mut ColumnWriter) {
        out.deltas(rows.iter().map(|r| r.used_last));
        out.scaled(rows.iter().map(|r| r.used_max.wrapping_sub(r.used_last)));
    }

    fn read_columns(
        key: i64,
        timestamps: Vec<i64>,
        r: &mut Reader<'_>,
    ) -> Result<Vec<Self>, ChunkError> {
        let n = timestamps.len();
        let used = r.deltas("used", n)?;
        let spread = r.scaled("used max", n)?;
        Ok(timestamps
            .into_iter()
            .zip(used)
            .zip(spread)
            .map(|((timestamp_ms, used_last), spread)| ProcessPoint {
                process_id: key,
                timestamp_ms,
                used_last,
                used_max: used_last.wrapping_add(spread),
            })
            .collect())
    }
}

/// A process's allocator reports: their counters move together with its
/// memory, so each is written against the one it moves with (reserved
/// against allocated, peak against allocated) where that is steadier.
impl Packable for AllocatorReport {
    fn timestamp_ms(&self) -> i64 {
        self.timestamp_ms
    }

    /// Allocator reports have no rollup tables: a week's chart of a
    /// process read every report (600,000 at 1 Hz) until its hours kept
    /// their minutes.
    fn minutes(compressor: &mut Compressor, rows: &[Self]) -> Result<Option<Vec<u8>>, ChunkError> {
        // A flush's chunk, the most common, is known short without folding.
        let minute = |r: Option<&Self>| r.map_or(0, |r| r.timestamp_ms.div_euclid(MINUTE_MS));
        if minute(rows.last()) - minute(rows.first()) + 1 < MINUTES_KEPT_FROM as i64 {
            return Ok(None);
        }
        let minutes = chart_fold::allocator_minutes(rows);
        if minutes.len() < MINUTES_KEPT_FROM || minutes.len() * 4 > rows.len() {
            return Ok(None);
        }
        encode_with(compressor, &minutes).map(Some)
    }

    fn put_columns(rows: &[Self], out: &mut ColumnWriter) {
        out.deltas(rows.iter().map(|r| r.allocated));
        out.deltas(rows.iter().map(|r| r.reserved.wrapping_sub(r.allocated)));
        out.deltas(rows.iter().map(|r| r.active.wrapping_sub(r.allocated)));
        out.deltas(rows.iter().map(|r| r.inactive_split));
        out.deltas(
            rows.iter()
                .map(|r| r.peak_allocated.wrapping_sub(r.allocated)),
        );
        out.deltas(rows.iter().map(|r| r.alloc_retries));
        out.deltas(rows.iter().map(|r| r.ooms));
        out.optional(rows.iter().map(|r| r.weights));
        out.optional(rows.iter().map(|r| r.gradients));
        out.optional(rows.iter().map(|r| r.optimizer_state));
    }

    fn read_columns(
        key: i64,
        timestamps: Vec<i64>,
        r: &mut Reader<'_>,
    ) -> Result<Vec<Self>, ChunkError> {
        let n = timestamps.len();
        let mut rows: Vec<Self> = timestamps
            .into_iter()
            .map(|timestamp_ms| AllocatorReport {
                process_id: key,
                timestamp_ms,
                ..AllocatorReport::default()
            })
            .collect();
        for (row, v) in rows.iter_mut().zip(r.deltas("allocated", n)?) {
            row.allocated = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("reserved", n)?) {
            row.reserved = row.allocated.wrapping_add(v);
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("active", n)?) {
            row.active = row.allocated.wrapping_add(v);
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("inactive split", n)?) {
            row.inactive_split = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("peak allocated", n)?) {
            row.peak_allocated = row.allocated.wrapping_add(v);
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("alloc retries", n)?) {
            row.alloc_retries = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("ooms", n)?) {
            row.ooms = v;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("weights", n)?) {
            row.weights = v;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("gradients", n)?) {
            row.gradients = v;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("optimizer state", n)?) {
            row.optimizer_state = v;
        }
        Ok(rows)
    }
}

/// A process's allocator reports folded a minute each, as a chart's
/// points are: each figure's highest and the newest report's time.
impl Packable for AllocatorPoint {
    fn timestamp_ms(&self) -> i64 {
        self.timestamp_ms
    }

    fn put_columns(rows: &[Self], out: &mut ColumnWriter) {
        out.deltas(rows.iter().map(|r| r.reports));
        out.deltas(rows.iter().map(|r| r.allocated_bytes));
        out.deltas(
            rows.iter()
                .map(|r| r.reserved_bytes.wrapping_sub(r.allocated_bytes)),
        );
        out.deltas(rows.iter().map(|r| r.fragmentation_bytes));
        out.deltas(rows.iter().map(|r| r.inactive_split_bytes));
        out.deltas(
            rows.iter()
                .map(|r| r.peak_allocated_bytes.wrapping_sub(r.allocated_bytes)),
        );
        out.deltas(rows.iter().map(|r| r.alloc_retries));
        out.deltas(rows.iter().map(|r| r.ooms));
        out.optional(rows.iter().map(|r| r.weights_bytes));
        out.optional(rows.iter().map(|r| r.gradients_bytes));
        out.optional(rows.iter().map(|r| r.optimizer_state_bytes));
    }

    fn read_columns(
        _key: i64,
        timestamps: Vec<i64>,
        r: &mut Reader<'_>,
    ) -> Result<Vec<Self>, ChunkError> {
        let n = timestamps.len();
        let mut rows: Vec<Self> = timestamps
            .into_iter()
            .map(|timestamp_ms| AllocatorPoint {
                timestamp_ms,
                ..AllocatorPoint::default()
            })
            .collect();
        for (row, v) in rows.iter_mut().zip(r.deltas("reports", n)?) {
            row.reports = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("allocated", n)?) {
            row.allocated_bytes = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("reserved", n)?) {
            row.reserved_bytes = row.allocated_bytes.wrapping_add(v);
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("fragmentation", n)?) {
            row.fragmentation_bytes = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("inactive split", n)?) {
            row.inactive_split_bytes = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("peak allocated", n)?) {
            row.peak_allocated_bytes = row.allocated_bytes.wrapping_add(v);
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("alloc retries", n)?) {
            row.alloc_retries = v;
        }
        for (row, v) in rows.iter_mut().zip(r.deltas("ooms", n)?) {
            row.ooms = v;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("weights", n)?) {
            row.weights_bytes = v;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("gradients", n)?) {
            row.gradients_bytes = v;
        }
        for (row, v) in rows.iter_mut().zip(r.optional("optimizer state", n)?) {
            row.optimizer_state_bytes = v;
        }
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk_columns::put_signed;

    const FORMAT_V1: u8 = ColumnFormat::V1 as u8;

    fn encode_v1<T: Packable>(rows: &[T]) -> Vec<u8> {
        encode_in(ColumnFormat::V1, &mut Compressor::new().unwrap(), rows).unwrap()
    }

    fn gpu_decode(key: i64, chunk: &[u8]) -> Result<Vec<GpuSampleRow>, ChunkError> {
        decode(key, chunk)
    }

    #[test]
    fn a_process_hour_reads_back_and_a_steady_one_is_tiny() {
        let rows: Vec<ProcessPoint> = (0..3600)
            .map(|i| ProcessPoint {
                process_id: 41,
                timestamp_ms: 1_764_547_200_000 + i * 1000,
                used_last: (12 << 30) + (i / 600) * (256 << 20),
                used_max: (12 << 30) + (i / 600) * (256 << 20) + (i % 3) * (2 << 20),
            })
            .collect();
        let chunk = encode(&rows).unwrap();
        assert_eq!(decode::<ProcessPoint>(41, &chunk).unwrap(), rows);
        assert!(chunk.len() < 3600 / 2, "{} bytes", chunk.len());
    }

    /// A training job's allocator report `i` seconds into an hour.
    fn job_report(i: i64) -> AllocatorReport {
        let allocated = (30 << 30) + (i % 7) * (512 << 20);
        AllocatorReport {
            process_id: 41,
            timestamp_ms: 1_764_547_200_000 + i * 1000 + i % 3,
            allocated,
            reserved: (50 << 30) + (i % 11) * (2 << 20),
            active: allocated + (1 << 20),
            inactive_split: (i / 600) * (64 << 20),
            peak_allocated: 40 << 30,
            alloc_retries: i / 900,
            ooms: i64::from(i == 1234),
            weights: (i % 10 == 0).then_some(7 << 30),
            gradients: None,
            optimizer_state: (i % 10 == 0).then_some(14 << 30),
        }
    }

    /// A week's chart of a process reads an hour's 60 minutes, not its
    /// 3,600 reports; a flush's minute of reports keeps none.
    #[test]
    fn an_allocator_hour_keeps_its_minutes_and_charts_the_same_from_them() {
        let reports: Vec<AllocatorReport> = (0..3600).map(job_report).collect();
        let chunks = chunks_by_hour(41, reports.clone()).unwrap();
        let [hour] = &chunks[..] else {
            panic!("one chunk, not {}", chunks.len())
        };
        let minutes = hour.minutes.as_deref().expect("an hour keeps its minutes");
        let points = decode_minutes_checked(hour, minutes).unwrap();
        assert_eq!(points.len(), 60);
        assert_eq!(points.iter().map(|p| p.reports).sum::<i64>(), 3600);
        assert!(minutes.len() < 60 * 8, "{} bytes of minutes", minutes.len());
        let a_minute = chunks_by_hour(41, reports[..60].to_vec()).unwrap();
        assert_eq!(a_minute[0].minutes, None);
        // Three minutes are kept; two are not, nor three minutes of fewer
        // than four reports a minute.
        let kept =
            |rows: Vec<AllocatorReport>| chunks_by_hour(41, rows).unwrap()[0].minutes.is_some();
        assert!(kept(reports[..121].to_vec()));
        assert!(!kept(reports[..120].to_vec()));
        assert!(!kept(reports[..121].iter().step_by(20).copied().collect()));

        // Buckets of 7 min 13 s from an odd start: the same from the
        // minutes as from the reports, the OOM and the counted parts kept.
        let (from, to, width) = (hour.hour_ms - 17_321, hour.hour_ms + HOUR_MS, 433_000);
        let chart = |chunk: &Chunk| {
            let mut fold = AllocatorFold::new(from, width);
            assert!(fold_allocator_chunk(&mut fold, chunk, from, to));
            fold.points()
        };
        let from_reports = chart(&Chunk {
            minutes: None,
            ..hour.clone()
        });
        assert_eq!(chart(hour), from_reports);
        assert_eq!(from_reports.iter().map(|p| p.ooms).max(), Some(1));
        assert_eq!(from_reports[0].optimizer_state_bytes, Some(14 << 30));

        // Minutes that do not decode, or miscount the chunk, are refused:
        // the caller reads the reports instead.
        let mut fold = AllocatorFold::new(from, width);
        let damaged = Chunk {
            minutes: Some(minutes[..minutes.len() / 2].to_vec()),
            ..hour.clone()
        };
        assert!(!fold_allocator_chunk(&mut fold, &damaged, from, to));
        let miscounted = Chunk {
            samples: 3599,
            ..hour.clone()
        };
        assert_eq!(
            decode_minutes_checked(&miscounted, minutes),
            Err(ChunkError::Mismatch)
        );
        let moved = Chunk {
            last_ts_ms: hour.last_ts_ms - MINUTE_MS,
            ..hour.clone()
        };
        assert_eq!(
            decode_minutes_checked(&moved, minutes),
            Err(ChunkError::Mismatch),
            "a minute past the chunk's span"
        );
    }

    /// A training job's hour of reports, one a second: allocated moving
    /// with each step, the rest steady, its composition counted every 10 s.
    #[test]
    fn an_hour_of_allocator_reports_reads_back_exactly_and_small() {
        let rows: Vec<AllocatorReport> = (0..3600i64)
            .map(|i| {
                let allocated = (30 << 30) + (i % 7) * (512 << 20);
                let counted = (i % 10 == 0).then_some(7 << 30);
                AllocatorReport {
                    process_id: 41,
                    timestamp_ms: 1_764_547_200_000 + i * 1000 + i % 3,
                    allocated,
                    reserved: 50 << 30,
                    active: allocated + (1 << 20),
                    inactive_split: (i / 600) * (64 << 20),
                    peak_allocated: 40 << 30,
                    alloc_retries: i / 900,
                    ooms: 0,
                    weights: counted,
                    gradients: counted,
                    optimizer_state: counted.map(|b| 2 * b),
                }
            })
            .collect();
        let chunk = encode(&rows).unwrap();
        assert_eq!(decode::<AllocatorReport>(41, &chunk).unwrap(), rows);
        // A row per report took about 150 bytes.
        assert!(chunk.len() < 3600 / 4, "{} bytes", chunk.len());
        let extreme = AllocatorReport {
            process_id: 41,
            timestamp_ms: 0,
            allocated: i64::MIN,
            reserved: i64::MAX,
            active: i64::MAX,
            inactive_split: i64::MIN,
            peak_allocated: i64::MIN,
            alloc_retries: i64::MAX,
            ooms: i64::MIN,
            weights: Some(i64::MIN),
            gradients: None,
            optimizer_state: Some(i64::MAX),
        };
        // Deltas that wrap between one report and the next.
        let opposite = AllocatorReport {
            timestamp_ms: 1,
            allocated: i64::MAX,
            reserved: i64::MIN,
            active: i64::MIN,
            inactive_split: i64::MAX,
            peak_allocated: i64::MAX,
            alloc_retries: i64::MIN,
            ooms: i64::MAX,
            weights: None,
            gradients: Some(i64::MIN),
            optimizer_state: Some(i64::MIN),
            ..extreme
        };
        let swinging = [
            extreme,
            opposite,
            AllocatorReport {
                timestamp_ms: 2,
                ..extreme
            },
        ];
        let chunk = encode(&swinging).unwrap();
        assert_eq!(decode::<AllocatorReport>(41, &chunk).unwrap(), swinging);
    }

    fn sample(ts: i64, used: i64) -> GpuSampleRow {
        GpuSampleRow {
            device_id: 7,
            timestamp_ms: ts,
            interval_ms: 1000,
            poll_count: 10,
            used_last: used,
            used_min: used - (3 << 20),
            used_max: used + (40 << 20),
            reserved: 512 << 20,
            total: 80 << 30,
            utilization_pct: Some(93),
            pcie_tx_bytes_per_s: Some(12_000_000),
            pcie_rx_bytes_per_s: None,
        }
    }

    #[test]
    fn a_series_hour_compacts_into_one_chunk_leaving_a_damaged_one() {
        let start = 1_764_547_200_000;
        let minute = |m: i64| -> Vec<GpuSampleRow> {
            (0..60)
                .map(|s| sample(start + (m * 60 + s) * 1000, (10 << 30) + s))
                .collect()
        };
        let mut chunks: Vec<Chunk> = (0..3)
            .flat_map(|m| chunks_by_hour(7, minute(m)).unwrap())
            .collect();
        // A replay wrote minute 1 a second time.
        chunks.extend(chunks_by_hour(7, minute(1)).unwrap());
        chunks[2].data.truncate(4);
        let refs: Vec<&Chunk> = chunks.iter().collect();
        let mut compressor = Compressor::new().unwrap();
        let (replaced, compacted) =
            compact_series::<GpuSampleRow>(&mut compressor, "gpu_samples_packed", &refs)
                .unwrap()
                .unwrap();
        assert_eq!(replaced, [0, 1, 3], "the damaged chunk stays");
        assert_eq!(compacted.len(), 1);
        let samples = decode_checked::<GpuSampleRow>(&compacted[0]).unwrap();
        assert_eq!(samples, [minute(0), minute(1)].concat(), "minute 1 once");
        let one_good = [refs[0], refs[2]];
        assert!(
            compact_series::<GpuSampleRow>(&mut compressor, "gpu_samples_packed", &one_good)
                .unwrap()
                .is_none(),
            "nothing to fold"
        );
    }

    fn an_hour() -> Vec<GpuSampleRow> {
        let start = 1_764_547_200_000;
        (0..3600)
            .map(|i| {
                let mut s = sample(
                    start + i * 1000 + (i % 7),
                    (20 << 30) + (i % 13) * (2 << 20),
                );
                if i % 50 == 0 {
                    s.utilization_pct = None;
                    s.pcie_tx_bytes_per_s = None;
                    s.pcie_rx_bytes_per_s = Some(i * 1024);
                }
                s
            })
            .collect()
    }

    #[test]
    fn an_hour_reads_back_exactly_and_small() {
        let rows = an_hour();
        let chunk = encode(&rows).unwrap();
        assert_eq!(gpu_decode(7, &chunk).unwrap(), rows);
        // 3,600 raw rows are about 500 kB on disk.
        assert!(chunk.len() < 3600 * 4, "{} bytes", chunk.len());
    }

    #[test]
    fn extreme_values_survive_the_deltas() {
        let mut rows = vec![sample(i64::MIN, 1 << 40), sample(i64::MAX, 0), sample(0, 0)];
        (rows[0].used_last, rows[0].used_min) = (i64::MAX, i64::MIN);
        (rows[1].used_last, rows[1].used_max) = (i64::MIN, i64::MAX);
        rows[2].utilization_pct = Some(i16::MIN);
        rows[2].interval_ms = i32::MAX;
        rows[2].pcie_rx_bytes_per_s = Some(i64::MIN);
        assert_eq!(gpu_decode(7, &encode(&rows).unwrap()).unwrap(), rows);
        assert_eq!(
            gpu_decode(7, &encode::<GpuSampleRow>(&[]).unwrap()).unwrap(),
            vec![]
        );
    }

    #[test]
    fn an_hour_splits_into_chunks_on_hour_boundaries() {
        let mut rows = an_hour();
        rows.extend((0..10).map(|i| sample(1_764_547_200_000 - 5000 + i * 1000, 1 << 30)));
        rows.reverse();
        let chunks = chunks_by_hour(7, rows).unwrap();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].hour_ms, 1_764_547_200_000 - HOUR_MS);
        assert_eq!(chunks[0].samples, 5);
        assert_eq!(chunks[1].samples, 3605);
        assert_eq!(chunks[1].first_ts_ms, 1_764_547_200_000);
        let back: Vec<_> = chunks
            .iter()
            .flat_map(|c| gpu_decode(7, &c.data).unwrap())
            .collect();
        assert!(back.is_sorted_by_key(|r| r.timestamp_ms));
        assert_eq!(back.len(), 3610);
    }

    #[test]
    fn a_chunk_is_checked_against_its_row() {
        let chunks = chunks_by_hour(7, an_hour()).unwrap();
        let good = &chunks[0];
        assert_eq!(decode_checked::<GpuSampleRow>(good).unwrap().len(), 3600);
        let miscounted = Chunk {
            samples: 3599,
            ..good.clone()
        };
        assert_eq!(
            decode_checked::<GpuSampleRow>(&miscounted),
            Err(ChunkError::Mismatch)
        );
        let other_hour = Chunk {
            hour_ms: good.hour_ms + HOUR_MS,
            ..good.clone()
        };
        assert_eq!(
            decode_checked::<GpuSampleRow>(&other_hour),
            Err(ChunkError::Mismatch)
        );
    }

    #[test]
    fn damage_is_named_not_panicked_on() {
        let chunk = encode(&an_hour()).unwrap();
        assert_eq!(gpu_decode(7, &[]), Err(ChunkError::Empty));
        assert_eq!(gpu_decode(7, &[9, 0]), Err(ChunkError::Format(9)));
        assert!(matches!(
            gpu_decode(7, &chunk[..chunk.len() / 2]),
            Err(ChunkError::Compression(_))
        ));
        let mut huge = vec![FORMAT_V1];
        put_varint(&mut huge, u64::MAX >> 1);
        assert!(matches!(gpu_decode(7, &huge), Err(ChunkError::TooLarge(_))));
        // A well-formed frame whose columns stop early.
        let mut short = Vec::new();
        put_varint(&mut short, 3);
        put_signed(&mut short, 1000);
        let mut framed = vec![FORMAT_V1];
        put_varint(&mut framed, short.len() as u64);
        framed.extend_from_slice(&zstd::bulk::compress(&short, 1).unwrap());
        assert_eq!(
            gpu_decode(7, &framed),
            Err(ChunkError::Truncated("timestamp"))
        );
    }

    /// An hour of the storage bench's GPU: memory on a plateau with
    /// allocator jitter in 2 MiB steps, utilization and PCIe rates drawn at
    /// random each second. About 9.2 bytes a sample is their entropy.
    fn noisy_hour() -> Vec<GpuSampleRow> {
        let mut state = 11u64;
        let mut next = move |bound: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % bound
        };
        (0..3600)
            .map(|i| {
                let used = ((30 << 30) + (i << 20) + next(64 << 20) as i64) / (2 << 20) * (2 << 20);
                GpuSampleRow {
                    used_last: used,
                    used_min: used - (next(128) as i64) * (2 << 20),
                    used_max: used + (next(256) as i64) * (2 << 20),
                    utilization_pct: Some(60 + next(41) as i16),
                    pcie_tx_bytes_per_s: Some(next(16_000_000) as i64 * 1024),
                    pcie_rx_bytes_per_s: Some(next(16_000_000) as i64 * 1024),
                    ..sample(1_764_547_200_000 + i * 1000, 0)
                }
            })
            .collect()
    }

    #[test]
    fn noisy_figures_cost_about_their_entropy_where_format_1_took_a_third_more() {
        let rows = noisy_hour();
        for samples in [3600, 60, 2] {
            let rows = &rows[..samples];
            let v2 = encode(rows).unwrap();
            let v1 = encode_v1(rows);
            assert_eq!(gpu_decode(7, &v2).unwrap(), rows);
            assert_eq!(gpu_decode(7, &v1).unwrap(), rows);
            let per_sample = |chunk: &[u8]| chunk.len() as f64 / samples as f64;
            eprintln!(
                "{samples} samples: format 1 {:.2}, format 2 {:.2} bytes a sample",
                per_sample(&v1),
                per_sample(&v2)
            );
            if samples == 2 {
                // A chunk of two samples is mostly its columns' headers:
                // format 2's mode bytes cost a few bytes more.
                assert!(
                    v2.len() <= v1.len() + 8,
                    "{} against {}",
                    v2.len(),
                    v1.len()
                );
                continue;
            }
            let bound = if samples == 3600 { 9.6 } else { 11.5 };
            assert!(per_sample(&v2) < bound, "{:.2}", per_sample(&v2));
            assert!(
                v2.len() * 5 < v1.len() * 4,
                "{} against {}",
                v2.len(),
                v1.len()
            );
        }
    }

    /// Not a test but a side-by-side measurement of what each format costs
    /// a flush and a chart in CPU, in one run:
    /// `cargo test --release -p headroom-store --lib chunk_format_cpu -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement; run with --release"]
    fn chunk_format_cpu() {
        let hour = noisy_hour();
        let mut compressor = Compressor::new().unwrap();
        for (label, samples, rounds) in [("a minute", 60, 20_000), ("an hour", 3600, 300)] {
            let rows = &hour[..samples];
            for format in [ColumnFormat::V1, ColumnFormat::V2] {
                let mut times = Vec::new();
                let mut decode_times = Vec::new();
                for _ in 0..5 {
                    let started = std::time::Instant::now();
                    let mut chunk = Vec::new();
                    for _ in 0..rounds {
                        chunk = encode_in(format, &mut compressor, rows).unwrap();
                    }
                    times.push(started.elapsed().as_secs_f64() * 1e6 / rounds as f64);
                    let started = std::time::Instant::now();
                    for _ in 0..rounds {
                        assert_eq!(gpu_decode(7, &chunk).unwrap().len(), samples);
                    }
                    decode_times.push(started.elapsed().as_secs_f64() * 1e6 / rounds as f64);
                }
                times.sort_by(f64::total_cmp);
                decode_times.sort_by(f64::total_cmp);
                eprintln!(
                    "{label} of a noisy GPU, format {}: encode {:.1} µs, decode {:.1} µs (medians of 5)",
                    format as u8, times[2], decode_times[2]
                );
            }
        }
        // What compaction adds to an allocator hour: its minutes.
        let reports: Vec<AllocatorReport> = (0..3600).map(job_report).collect();
        let median = |work: &mut dyn FnMut()| {
            let mut times: Vec<f64> = (0..5)
                .map(|_| {
                    let started = std::time::Instant::now();
                    (0..300).for_each(|_| work());
                    started.elapsed().as_secs_f64() * 1e6 / 300.0
                })
                .collect();
            times.sort_by(f64::total_cmp);
            times[2]
        };
        let encode = median(&mut || {
            encode_with(&mut compressor, &reports).unwrap();
        });
        let minutes = median(&mut || {
            AllocatorReport::minutes(&mut compressor, &reports).unwrap();
        });
        eprintln!(
            "an hour of allocator reports: encode {encode:.1} µs, its minutes {minutes:.1} µs (medians of 5)"
        );
    }

    #[test]
    fn chunks_written_in_format_1_still_read() {
        let rows = an_hour();
        let v1 = encode_v1(&rows);
        assert_eq!(v1[0], FORMAT_V1);
        assert_eq!(gpu_decode(7, &v1).unwrap(), rows);
        let processes: Vec<ProcessPoint> = (0..600)
            .map(|i| ProcessPoint {
                process_id: 9,
                timestamp_ms: 1_764_547_200_000 + i * 1000,
                used_last: (4 << 30) + (i / 100) * (2 << 20),
                used_max: (4 << 30) + (i / 100) * (2 << 20) + (i % 5) * (2 << 20),
            })
            .collect();
        assert_eq!(
            decode::<ProcessPoint>(9, &encode_v1(&processes)).unwrap(),
            processes
        );
    }

    proptest::proptest! {
        #[test]
        fn any_samples_read_back_exactly(
            raw in proptest::collection::vec(
                (proptest::prelude::any::<(i64, i32, i32, i64, i64, i64, i64, i64)>(),
                 proptest::prelude::any::<(Option<i16>, Option<i64>, Option<i64>)>()),
                0..200,
            )
        ) {
            let rows: Vec<GpuSampleRow> = raw
                .into_iter()
                .map(|((ts, interval, polls, used, min, max, reserved, total), (util, tx, rx))| {
                    GpuSampleRow {
                        device_id: 3,
                        timestamp_ms: ts,
                        interval_ms: interval,
                        poll_count: polls,
                        used_last: used,
                        used_min: min,
                        used_max: max,
                        reserved,
                        total,
                        utilization_pct: util,
                        pcie_tx_bytes_per_s: tx,
                        pcie_rx_bytes_per_s: rx,
                    }
                })
                .collect();
            let chunk = encode(&rows).unwrap();
            proptest::prop_assert_eq!(&gpu_decode(3, &chunk).unwrap(), &rows);
            proptest::prop_assert_eq!(gpu_decode(3, &encode_v1(&rows)).unwrap(), rows);
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            cut in 0usize..400,
        ) {
            for format in [FORMAT_V1, ColumnFormat::V2 as u8] {
                let mut chunk = vec![format];
                chunk.extend(&tail);
                let _ = gpu_decode(3, &chunk);
            }
            // A real chunk cut short or with a byte flipped.
            for mut real in [encode(&an_hour()[..50]).unwrap(), encode(&noisy_hour()[..50]).unwrap()] {
                real.truncate(cut.max(1));
                let _ = gpu_decode(3, &real);
                if let Some(b) = real.get_mut(cut / 2) {
                    *b ^= 0x5a;
                }
                let _ = gpu_decode(3, &real);
            }
        }
    }
}
