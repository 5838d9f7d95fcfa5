//! What both backends share about rollups and retention: the resolutions,
//! which one a range query reads, how long each is kept, and the small
//! arithmetic on buckets. The SQL lives with each backend.

use serde::{Deserialize, Serialize};

pub const MINUTE_MS: i64 = 60_000;
pub const HOUR_MS: i64 = 3_600_000;
pub const DAY_MS: i64 = 86_400_000;

/// The rollup job leaves the newest minutes alone for this long, so that a
/// minute is rolled up once its samples are in, not while they arrive. Late
/// samples (an agent's spool) mark their minute for another pass.
pub const ROLLUP_GRACE_MS: i64 = 2 * MINUTE_MS;

/// How far one maintenance pass moves the minute watermark: a collector that
/// was down for a week catches up in bounded steps, not one huge statement.
pub const MAX_CATCH_UP_MS: i64 = 6 * HOUR_MS;

/// How long each resolution is kept, and how maintenance runs.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Raw samples (one row per GPU per sample interval), process and
    /// allocator samples.
    pub raw_retention_days: u32,
    /// One-minute rollups, and agent events (XIDs, lost GPUs).
    pub minute_retention_days: u32,
    /// One-hour rollups.
    pub hour_retention_days: u32,
    /// Seconds between maintenance passes (partitions ahead, rollups,
    /// retention). Only one collector per database does the work.
    pub maintenance_interval_s: u32,
    /// Postgres: raw GPU and process samples of a day that ended this many
    /// hours ago are packed into compressed chunks (0: never). They still
    /// chart at full resolution; a late sample for a packed day is still
    /// rolled up.
    pub pack_raw_after_hours: u32,
    /// Seconds a maintenance pass spends packing days (Postgres), and again
    /// compacting closed hours' chunks (both stores), at most; a day
    /// bigger than that is packed over several passes. Each pass packs at
    /// least one transaction of each table (a GPU, or eight processes), so
    /// even 0 makes progress, slowly. Rollups wait while it runs.
    pub pack_seconds_per_pass: u32,
    /// How GPU and process samples are written.
    pub sample_writes: SampleWrites,
    /// Chunked writes: the oldest sample held in memory is written
    /// within this many seconds (1 to 60). Agents keep every batch until
    /// then; a longer wait makes fewer, smaller-per-sample chunks.
    pub chunk_flush_s: u32,
    /// Chunked writes: past this many MiB of samples held in
    /// memory, they are written at once, so the collector's memory stays
    /// bounded whatever the fleet's size.
    pub chunk_memory_mib: u32,
}

/// How a store writes samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SampleWrites {
    /// Each series' samples are held in memory and written as one
    /// compressed chunk per flush; agents' spools hold them meanwhile.
    #[default]
    Chunks,
    /// A row per sample, packed into chunks a day later: the layout before
    /// chunks, kept for a rolling upgrade (collectors of both kinds on one
    /// database) and for comparison.
    Rows,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            raw_retention_days: 7,
            minute_retention_days: 90,
            hour_retention_days: 730,
            maintenance_interval_s: 20,
            pack_raw_after_hours: 24,
            pack_seconds_per_pass: 10,
            sample_writes: SampleWrites::Chunks,
            chunk_flush_s: 60,
            chunk_memory_mib: 256,
        }
    }
}

impl StorageConfig {
    pub fn raw_retention_ms(&self) -> i64 {
        i64::from(self.raw_retention_days.max(1)) * DAY_MS
    }

    pub fn minute_retention_ms(&self) -> i64 {
        i64::from(self.minute_retention_days.max(1)) * DAY_MS
    }

    /// How long after a day ends its raw samples are packed, if ever.
    pub fn pack_raw_after_ms(&self) -> Option<i64> {
        (self.pack_raw_after_hours > 0).then(|| i64::from(self.pack_raw_after_hours) * HOUR_MS)
    }

    /// How long one maintenance pass may spend packing.
    pub fn pack_time_per_pass(&self) -> std::time::Duration {
        std::time::Duration::from_secs(u64::from(self.pack_seconds_per_pass))
    }

    pub fn hour_retention_ms(&self) -> i64 {
        i64::from(self.hour_retention_days.max(1)) * DAY_MS
    }

    /// When open chunks are written.
    pub fn chunk_limits(&self) -> crate::open_chunks::ChunkLimits {
        crate::open_chunks::ChunkLimits {
            flush_after_ms: i64::from(self.chunk_flush_s.clamp(1, 60)) * 1000,
            max_bytes: (self.chunk_memory_mib.max(1) as usize) << 20,
        }
    }

    /// A problem with the values, named, or `None`.
    pub fn problem(&self) -> Option<String> {
        if !(1..=60).contains(&self.chunk_flush_s) || self.chunk_memory_mib == 0 {
            return Some(format!(
                "storage.chunk_flush_s must be 1 to 60 (is {}) and storage.chunk_memory_mib at least 1",
                self.chunk_flush_s
            ));
        }
        if self.raw_retention_days == 0 || self.maintenance_interval_s == 0 {
            return Some(
                "storage.raw_retention_days and storage.maintenance_interval_s must be at least 1"
                    .into(),
            );
        }
        if self.minute_retention_days < self.raw_retention_days
            || self.hour_retention_days < self.minute_retention_days
        {
            return Some(format!(
                "storage retention must grow with the step: raw {} d ≤ 1 min {} d ≤ 1 h {} d",
                self.raw_retention_days, self.minute_retention_days, self.hour_retention_days
            ));
        }
        None
    }
}

/// The table a range query reads most of its points from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    Raw,
    Minute,
    Hour,
}

/// How far each rollup is complete: every minute before `minute_ms` is in
/// the 1 min tables, every hour before `hour_ms` in the 1 h tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Watermarks {
    pub minute_ms: i64,
    pub hour_ms: i64,
}

/// Which part of `[from, to]` each table serves: the 1 h table
/// `[from, hour_end)`, the 1 min table `[hour_end, minute_end)`, raw samples
/// `[minute_end, to]`. The rollups end where they are complete, so a chart
/// is always current up to its newest raw sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceBounds {
    pub hour_end_ms: i64,
    pub minute_end_ms: i64,
}

/// The coarsest resolution whose step still fits a bucket of the chart, made
/// coarser where the range starts before the finer data's retention.
pub fn resolution_for(
    from_ms: i64,
    bucket_width_ms: i64,
    watermarks: Watermarks,
    storage: &StorageConfig,
) -> Resolution {
    let by_width = if bucket_width_ms >= HOUR_MS {
        Resolution::Hour
    } else if bucket_width_ms >= MINUTE_MS {
        Resolution::Minute
    } else {
        Resolution::Raw
    };
    // The minute watermark trails the newest samples by a couple of minutes:
    // good enough a clock for deciding what retention has already dropped.
    let newest = watermarks.minute_ms;
    let raw_gone = from_ms < newest.saturating_sub(storage.raw_retention_ms());
    let minutes_gone = from_ms < newest.saturating_sub(storage.minute_retention_ms());
    match by_width {
        Resolution::Raw | Resolution::Minute if minutes_gone => Resolution::Hour,
        Resolution::Raw if raw_gone => Resolution::Minute,
        other => other,
    }
}

pub fn source_bounds(
    resolution: Resolution,
    from_ms: i64,
    to_ms: i64,
    watermarks: Watermarks,
) -> SourceBounds {
    // The rollups serve no further than the range's own end (inclusive).
    let end = to_ms.saturating_add(1).max(from_ms);
    match resolution {
        Resolution::Raw => SourceBounds {
            hour_end_ms: from_ms,
            minute_end_ms: from_ms,
        },
        Resolution::Minute => SourceBounds {
            hour_end_ms: from_ms,
            minute_end_ms: from_ms.max(watermarks.minute_ms).min(end),
        },
        Resolution::Hour => {
            let hour_end_ms = from_ms.max(watermarks.hour_ms).min(end);
            SourceBounds {
                hour_end_ms,
                minute_end_ms: hour_end_ms.max(watermarks.minute_ms).min(end),
            }
        }
    }
}

/// Which part of `[from, to]` the fleet tables serve: the resolution a
/// device series of the same buckets reads, but minutes where it would
/// read raw samples, since the fleet has no raw rows (summing every GPU's
/// samples at query time is what the fleet tables exist to avoid). Past
/// `minute_end_ms` nothing serves: those minutes are not rolled up yet.
pub fn fleet_source_bounds(
    from_ms: i64,
    to_ms: i64,
    bucket_width_ms: i64,
    watermarks: Watermarks,
    storage: &StorageConfig,
) -> SourceBounds {
    let resolution = match resolution_for(from_ms, bucket_width_ms, watermarks, storage) {
        Resolution::Raw => Resolution::Minute,
        other => other,
    };
    source_bounds(resolution, from_ms, to_ms, watermarks)
}

/// Where one pass moves the minute watermark from `done_ms`: to the last
/// minute that ended a grace period ago, at most [`MAX_CATCH_UP_MS`] on.
/// `None` when there is nothing to move.
pub fn next_minute_watermark(done_ms: i64, now_ms: i64) -> Option<i64> {
    let target = bucket_start(now_ms - ROLLUP_GRACE_MS, MINUTE_MS).min(done_ms + MAX_CATCH_UP_MS);
    (target > done_ms).then_some(target)
}

/// Start of the bucket of width `step_ms` holding `ts_ms`.
pub fn bucket_start(ts_ms: i64, step_ms: i64) -> i64 {
    ts_ms - ts_ms.rem_euclid(step_ms)
}

/// Sorted, distinct bucket starts grouped into runs of adjacent buckets, as
/// `[start, end)` ranges: one range scan each when rolling them up.
pub fn contiguous_runs(buckets: &[i64], step_ms: i64) -> Vec<(i64, i64)> {
    let mut sorted = buckets.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(i64, i64)> = Vec::new();
    for bucket in sorted {
        match runs.last_mut() {
            Some((_, end)) if *end == bucket => *end = bucket + step_ms,
            _ => runs.push((bucket, bucket + step_ms)),
        }
    }
    runs
}

/// The distinct minutes of `timestamps`, in order.
pub fn minutes_of(timestamps: impl Iterator<Item = i64>) -> Vec<i64> {
    let mut minutes: Vec<i64> = Vec::new();
    for minute in timestamps.map(|ts| bucket_start(ts, MINUTE_MS)) {
        // Samples come in runs of one time (a batch's devices): most
        // repeats are the previous one's.
        if minutes.last() != Some(&minute) {
            minutes.push(minute);
        }
    }
    minutes.sort_unstable();
    minutes.dedup();
    minutes
}

/// The distinct minutes of `timestamps` that lie before `watermark_ms`: rows
/// that arrived after their minute was rolled up.
pub fn late_minutes(timestamps: impl Iterator<Item = i64>, watermark_ms: i64) -> Vec<i64> {
    minutes_of(timestamps.filter(|ts| *ts < watermark_ms))
}

/// What one maintenance pass did, for logs and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MaintenanceReport {
    /// False when another collector holds the maintenance lock: this one did
    /// nothing.
    pub leader: bool,
    pub partitions_created: u64,
    pub partitions_dropped: u64,
    /// Rows removed by retention from tables without partitions (every
    /// table on SQLite, the small fleet rollups on Postgres).
    pub rows_expired: u64,
    pub minutes_rolled_up: u64,
    pub hours_rolled_up: u64,
    /// Raw GPU and process samples moved into packed chunks (Postgres).
    pub samples_packed: u64,
    /// Chunks of closed hours folded into one per series and hour
    /// (Postgres): chunks read minus chunks written.
    pub chunks_compacted: u64,
    /// Minute rollup rows of closed hours moved into one row per series
    /// and hour (Postgres).
    pub minute_rows_packed: u64,
    /// Hour rollup rows of closed days moved into one row per series and
    /// day (Postgres).
    pub hour_rows_packed: u64,
    /// Where the rollups stand after the pass.
    pub watermarks: Option<Watermarks>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_796_000_000_000;

    fn marks() -> Watermarks {
        Watermarks {
            minute_ms: NOW - 3 * MINUTE_MS,
            hour_ms: bucket_start(NOW, HOUR_MS),
        }
    }

    #[test]
    fn a_day_on_a_thousand_points_reads_minutes_a_year_reads_hours() {
        let storage = StorageConfig::default();
        let day = 86_400_000 / 1000;
        assert_eq!(
            resolution_for(NOW - DAY_MS, day, marks(), &storage),
            Resolution::Minute
        );
        assert_eq!(
            resolution_for(NOW - 3_600_000, 3_600, marks(), &storage),
            Resolution::Raw
        );
        assert_eq!(
            resolution_for(NOW - 365 * DAY_MS, 365 * day, marks(), &storage),
            Resolution::Hour
        );
    }

    #[test]
    fn ranges_older_than_retention_read_the_rollup_that_still_has_them() {
        let storage = StorageConfig::default();
        // A one-hour window, eight days ago: raw samples are gone.
        assert_eq!(
            resolution_for(NOW - 8 * DAY_MS, 3_600, marks(), &storage),
            Resolution::Minute
        );
        // A one-hour window, 100 days ago: minutes are gone too.
        assert_eq!(
            resolution_for(NOW - 100 * DAY_MS, 3_600, marks(), &storage),
            Resolution::Hour
        );
    }

    #[test]
    fn rollups_serve_only_the_complete_part_and_raw_the_rest() {
        let m = marks();
        let from = NOW - DAY_MS;
        assert_eq!(
            source_bounds(Resolution::Minute, from, NOW, m),
            SourceBounds {
                hour_end_ms: from,
                minute_end_ms: m.minute_ms
            }
        );
        assert_eq!(
            source_bounds(Resolution::Hour, from, NOW, m),
            SourceBounds {
                hour_end_ms: m.hour_ms,
                minute_end_ms: m.minute_ms
            }
        );
        // A range that starts after the watermark reads raw samples only.
        let recent = NOW - MINUTE_MS;
        assert_eq!(
            source_bounds(Resolution::Hour, recent, NOW, m),
            SourceBounds {
                hour_end_ms: recent,
                minute_end_ms: recent
            }
        );
        // A range that ends before the watermarks reads rollups only, and
        // none past its end.
        let old_end = NOW - 2 * DAY_MS;
        assert_eq!(
            source_bounds(Resolution::Hour, from - DAY_MS, old_end, m),
            SourceBounds {
                hour_end_ms: old_end + 1,
                minute_end_ms: old_end + 1
            }
        );
    }

    #[test]
    fn the_fleet_reads_minutes_where_a_device_reads_raw_samples_and_hours_for_a_year() {
        let storage = StorageConfig::default();
        let m = marks();
        let from = NOW - HOUR_MS;
        assert_eq!(
            fleet_source_bounds(from, NOW, 3_600, m, &storage),
            SourceBounds {
                hour_end_ms: from,
                minute_end_ms: m.minute_ms
            }
        );
        let year = NOW - 365 * DAY_MS;
        assert_eq!(
            fleet_source_bounds(year, NOW, 365 * DAY_MS / 1000, m, &storage),
            SourceBounds {
                hour_end_ms: m.hour_ms,
                minute_end_ms: m.minute_ms
            }
        );
    }

    #[test]
    fn the_minute_watermark_trails_by_the_grace_and_catches_up_in_steps() {
        let now = 100 * DAY_MS + 30_000;
        assert_eq!(
            next_minute_watermark(now - 10 * MINUTE_MS, now),
            Some(bucket_start(now - ROLLUP_GRACE_MS, MINUTE_MS))
        );
        assert_eq!(next_minute_watermark(now - MINUTE_MS, now), None);
        assert_eq!(
            next_minute_watermark(now - DAY_MS, now),
            Some(now - DAY_MS + MAX_CATCH_UP_MS)
        );
    }

    #[test]
    fn runs_join_adjacent_buckets() {
        let m = MINUTE_MS;
        assert_eq!(
            contiguous_runs(&[5 * m, 3 * m, 4 * m, 9 * m, 3 * m], m),
            vec![(3 * m, 6 * m), (9 * m, 10 * m)]
        );
        assert!(contiguous_runs(&[], m).is_empty());
    }

    #[test]
    fn only_minutes_before_the_watermark_are_late() {
        let m = MINUTE_MS;
        let ts = [10 * m + 5, 10 * m + 7, 11 * m, 12 * m + 1];
        assert_eq!(late_minutes(ts.into_iter(), 12 * m), vec![10 * m, 11 * m]);
        assert_eq!(bucket_start(-1, m), -m);
    }

    #[test]
    fn retention_must_grow_with_the_step() {
        assert!(StorageConfig::default().problem().is_none());
        let bad = StorageConfig {
            minute_retention_days: 3,
            ..StorageConfig::default()
        };
        assert!(bad.problem().is_some_and(|p| p.contains("raw 7 d")));
    }
}
