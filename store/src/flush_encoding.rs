//! What a flush writes, worked out from the samples it took: one chunk per
//! series and hour they touch, and their minute rollups. Pure CPU, run off
//! the async runtime; each store then writes the result its own way.

use std::sync::Arc;

use crate::StoreError;
use std::collections::BTreeMap;

use crate::chunk_format::{Chunk, Compressor, Packable, chunks_by_hour_with};
use crate::open_chunks::{GpuMinute, Held, ProcessMinute, Samples, gpu_minutes, process_minutes};
use crate::rollup::{HOUR_MS, bucket_start};

/// Chunks and rollups of a set of samples, computed off the async runtime.
pub(crate) struct Encoded {
    pub gpu_chunks: Vec<Chunk>,
    pub process_chunks: Vec<Chunk>,
    pub allocator_chunks: Vec<Chunk>,
    pub gpu_minutes: Vec<GpuMinute>,
    pub process_minutes: Vec<ProcessMinute>,
}

impl Encoded {
    /// Every chunk, of every kind.
    pub fn chunks(&self) -> impl Iterator<Item = &Chunk> {
        self.gpu_chunks
            .iter()
            .chain(&self.process_chunks)
            .chain(&self.allocator_chunks)
    }

    /// The samples its chunks hold, a time held twice once.
    pub fn samples(&self) -> usize {
        self.chunks()
            .map(|c| usize::try_from(c.samples).unwrap_or(0))
            .sum()
    }

    /// The hours its chunks go into, each once, in order: for compaction
    /// to find once they are closed.
    pub fn hours(&self) -> Vec<i64> {
        let mut hours: Vec<i64> = self.chunks().map(|c| c.hour_ms).collect();
        hours.sort_unstable();
        hours.dedup();
        hours
    }

    /// The minutes its rollups touch before `done_until_ms` (those the
    /// rollup pass already passed: a spool replayed after an outage), each
    /// once, in order.
    pub fn minutes_before(&self, done_until_ms: i64) -> Vec<i64> {
        let mut late: Vec<i64> = self
            .gpu_minutes
            .iter()
            .map(|m| m.minute_ms)
            .chain(self.process_minutes.iter().map(|m| m.minute_ms))
            .filter(|m| *m < done_until_ms)
            .collect();
        late.sort_unstable();
        late.dedup();
        late
    }

    /// The `(device, hour)` and `(process, hour)` pairs of its rollups'
    /// minutes before `done_until_ms`, each once: the series hours a late
    /// minute may find packed.
    pub fn late_series_hours(&self, done_until_ms: i64) -> (SeriesHours, SeriesHours) {
        (
            series_hours_before(
                self.gpu_minutes.iter().map(|m| (m.device_id, m.minute_ms)),
                done_until_ms,
            ),
            series_hours_before(
                self.process_minutes
                    .iter()
                    .map(|m| (m.process_id, m.minute_ms)),
                done_until_ms,
            ),
        )
    }
}

/// `(series id, start of the hour)` pairs, sorted, each once.
pub type SeriesHours = Vec<(i64, i64)>;

fn series_hours_before(
    minutes: impl Iterator<Item = (i64, i64)>,
    done_until_ms: i64,
) -> SeriesHours {
    let mut late: Vec<(i64, i64)> = minutes
        .filter(|(_, minute)| *minute < done_until_ms)
        .map(|(series, minute)| (series, bucket_start(minute, HOUR_MS)))
        .collect();
    late.sort_unstable();
    late.dedup();
    late
}

fn encode(samples: &Samples) -> Result<Encoded, StoreError> {
    let mut compressor =
        Compressor::new().map_err(|e| StoreError::Invalid(format!("no zstd context: {e}")))?;
    Ok(Encoded {
        gpu_chunks: series_chunks(&mut compressor, &samples.gpu, "device")?,
        process_chunks: series_chunks(&mut compressor, &samples.processes, "process")?,
        allocator_chunks: series_chunks(
            &mut compressor,
            &samples.allocator,
            "allocator reports of process",
        )?,
        gpu_minutes: gpu_minutes(samples),
        process_minutes: process_minutes(samples),
    })
}

/// Every series' held samples of one kind as chunks, a time held twice
/// (an agent's clock stepping back, a report joined to several intervals)
/// once. `series_name` names the series in an error.
fn series_chunks<T: Packable + Copy>(
    compressor: &mut Compressor,
    series: &BTreeMap<i64, Vec<Held<T>>>,
    series_name: &str,
) -> Result<Vec<Chunk>, StoreError> {
    let mut chunks = Vec::new();
    for (key, held) in series {
        let rows: Vec<T> = held.iter().map(|h| h.row).collect();
        chunks.extend(
            chunks_by_hour_with(compressor, *key, dedup(rows, T::timestamp_ms))
                .map_err(|e| StoreError::Damaged(format!("chunking {series_name} {key}: {e}")))?,
        );
    }
    Ok(chunks)
}

/// One sample per timestamp and series: an agent whose clock stepped back
/// may send a time twice, and a chart would draw both.
fn dedup<T>(mut rows: Vec<T>, ts: impl Fn(&T) -> i64) -> Vec<T> {
    rows.sort_by_key(&ts);
    rows.dedup_by_key(|r| ts(r));
    rows
}

pub(crate) async fn encode_off_runtime(samples: Arc<Samples>) -> Result<Encoded, StoreError> {
    tokio::task::spawn_blocking(move || encode(&samples))
        .await
        .map_err(|e| StoreError::Invalid(format!("encoding chunks failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_sent_twice_is_kept_once() {
        let rows = vec![(3, 'a'), (1, 'b'), (3, 'c'), (2, 'd')];
        let kept: Vec<i64> = dedup(rows, |r| r.0).iter().map(|r| r.0).collect();
        assert_eq!(kept, [1, 2, 3]);
    }
}
