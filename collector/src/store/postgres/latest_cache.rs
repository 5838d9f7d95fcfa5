//! The newest GPU sample this collector committed for each device, and what
//! it last wrote to the device's `gpu_latest` row.
//!
//! Rewriting a `gpu_latest` row costs Postgres about as much as inserting
//! the sample did, and every GPU sends one a second; so the row is a
//! checkpoint, rewritten when memory moves by at least 1 % of the device's
//! total, or at least every [`CHECKPOINT_MS`] of wall-clock time. This
//! collector's fleet overview lays its newest committed samples over the
//! rows, so for the devices it serves it is current to the second; another
//! collector on the same database sees a steady device at most
//! [`CHECKPOINT_MS`] late. A device that stops reporting gets its last
//! sample written once no newer one has come for [`CHECKPOINT_MS`] (while
//! other devices keep this collector writing) or when the collector closes;
//! a collector that dies leaves rows up to [`CHECKPOINT_MS`] behind.
//!
//! The pace is the wall clock's, not the samples': agents replaying a spool
//! send many seconds of samples a second, and neither their steady devices
//! nor the devices of agents that lag behind the others are rewritten any
//! more often for it.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::model::GpuSampleRow;

/// A steady device's `gpu_latest` row trails its newest sample by at most
/// this much wall-clock time.
pub(super) const CHECKPOINT_MS: i64 = 5_000;

/// How often, in wall-clock time, entries are scanned for quiet devices.
const QUIET_SCAN_EVERY_MS: i64 = 1_000;

/// Entries with no new sample for this long are forgotten (the device went
/// away or its agent moved to another collector).
const FORGET_AFTER_MS: i64 = 10 * 60_000;

#[derive(Debug, Clone, Copy)]
struct Known {
    /// The newest committed sample.
    newest: GpuSampleRow,
    /// When (wall clock) `newest` became the newest.
    newest_at_ms: i64,
    /// What the database row holds, as far as this collector wrote it.
    checkpoint: GpuSampleRow,
    /// When (wall clock) `checkpoint` was written.
    checkpoint_at_ms: i64,
}

#[derive(Debug, Default)]
pub(super) struct LatestCache {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    known: HashMap<i64, Known>,
    /// When quiet devices were last looked for.
    quiet_scan_ms: i64,
    size_after_sweep: usize,
}

impl Known {
    fn unwritten(&self) -> bool {
        self.newest.timestamp_ms > self.checkpoint.timestamp_ms
    }
}

/// True when `sample` moved memory far enough from `written` that a reader
/// of the row alone should see it now.
fn moved(sample: &GpuSampleRow, written: &GpuSampleRow) -> bool {
    let step = sample.total.max(written.total) / 100;
    sample.used_last.abs_diff(written.used_last) >= step.unsigned_abs()
        || sample.used_max.abs_diff(written.used_max) >= step.unsigned_abs()
        || sample.total != written.total
        || sample.reserved != written.reserved
}

impl LatestCache {
    /// What this transaction writes to `gpu_latest` at wall-clock time
    /// `now_ms`: the samples of `newest` (one per device, its newest in the
    /// group) that are due, and about once a second the unwritten newest
    /// samples of devices that went quiet. One row per device, in device
    /// order.
    pub(super) fn due(&self, newest: &[&GpuSampleRow], now_ms: i64) -> Vec<GpuSampleRow> {
        let Ok(mut inner) = self.inner.lock() else {
            return newest.iter().map(|s| **s).collect();
        };
        let mut due: Vec<GpuSampleRow> = newest
            .iter()
            .filter(|sample| match inner.known.get(&sample.device_id) {
                None => true,
                Some(known) => {
                    sample.timestamp_ms > known.checkpoint.timestamp_ms
                        && (now_ms >= known.checkpoint_at_ms + CHECKPOINT_MS
                            || moved(sample, &known.checkpoint))
                }
            })
            .map(|sample| **sample)
            .collect();
        if now_ms >= inner.quiet_scan_ms + QUIET_SCAN_EVERY_MS {
            inner.quiet_scan_ms = now_ms;
            let quiet_before = now_ms - CHECKPOINT_MS;
            let in_group = |device: i64| newest.iter().any(|s| s.device_id == device);
            due.extend(
                inner
                    .known
                    .values()
                    .filter(|k| k.unwritten() && k.newest_at_ms <= quiet_before)
                    .filter(|k| !in_group(k.newest.device_id))
                    .map(|k| k.newest),
            );
            due.sort_unstable_by_key(|s| s.device_id);
        }
        due
    }

    /// Every newest sample not yet in `gpu_latest`, for a collector that is
    /// closing; they count as written from here on.
    pub(super) fn take_unwritten(&self) -> Vec<GpuSampleRow> {
        let Ok(mut inner) = self.inner.lock() else {
            return Vec::new();
        };
        let mut unwritten = Vec::new();
        for known in inner.known.values_mut() {
            if known.unwritten() {
                unwritten.push(known.newest);
                known.checkpoint = known.newest;
            }
        }
        unwritten.sort_unstable_by_key(|s| s.device_id);
        unwritten
    }

    /// After the commit at wall-clock time `now_ms`: `newest` were
    /// committed, `written` (a subset) also went to `gpu_latest`.
    pub(super) fn learn(&self, newest: &[&GpuSampleRow], written: &[GpuSampleRow], now_ms: i64) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        for sample in newest {
            match inner.known.get_mut(&sample.device_id) {
                Some(known) => {
                    if sample.timestamp_ms > known.newest.timestamp_ms {
                        known.newest = **sample;
                        known.newest_at_ms = now_ms;
                    }
                }
                None => {
                    // Only a sample written to the row may start an entry:
                    // the checkpoint must be something the row holds.
                    if written.iter().any(|w| w.device_id == sample.device_id) {
                        inner.known.insert(
                            sample.device_id,
                            Known {
                                newest: **sample,
                                newest_at_ms: now_ms,
                                checkpoint: **sample,
                                checkpoint_at_ms: now_ms,
                            },
                        );
                    }
                }
            }
        }
        for sample in written {
            if let Some(known) = inner.known.get_mut(&sample.device_id)
                && sample.timestamp_ms >= known.checkpoint.timestamp_ms
            {
                known.checkpoint = *sample;
                known.checkpoint_at_ms = now_ms;
            }
        }
        if inner.known.len() > inner.size_after_sweep * 2 + 1024 {
            let cutoff = now_ms - FORGET_AFTER_MS;
            inner.known.retain(|_, k| k.newest_at_ms >= cutoff);
            inner.size_after_sweep = inner.known.len();
        }
    }

    /// The newest committed sample of `device_id` if it is newer than
    /// `row_ms`, the time of the sample its `gpu_latest` row holds.
    pub(super) fn newer_than(&self, device_id: i64, row_ms: Option<i64>) -> Option<GpuSampleRow> {
        let inner = self.inner.lock().ok()?;
        let known = inner.known.get(&device_id)?;
        (row_ms.is_none_or(|ms| known.newest.timestamp_ms > ms)).then_some(known.newest)
    }
}

/// One sample per device: the newest of each in `samples`.
pub(super) fn newest_per_device<'r>(samples: &[&'r GpuSampleRow]) -> Vec<&'r GpuSampleRow> {
    let mut newest: HashMap<i64, &GpuSampleRow> = HashMap::with_capacity(samples.len());
    for sample in samples {
        let entry = newest.entry(sample.device_id).or_insert(sample);
        if entry.timestamp_ms < sample.timestamp_ms {
            *entry = sample;
        }
    }
    // In device order: two writers updating the same rows lock them in the
    // same order.
    let mut newest: Vec<&GpuSampleRow> = newest.into_values().collect();
    newest.sort_unstable_by_key(|s| s.device_id);
    newest
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: i64 = 1 << 30;

    fn sample(ts: i64, used: i64) -> GpuSampleRow {
        GpuSampleRow {
            device_id: 3,
            timestamp_ms: ts,
            interval_ms: 1000,
            poll_count: 10,
            used_last: used,
            used_min: used,
            used_max: used,
            reserved: GIB / 2,
            total: 80 * GIB,
            utilization_pct: Some(50),
            pcie_tx_bytes_per_s: None,
            pcie_rx_bytes_per_s: None,
        }
    }

    /// A live agent's pace: each sample arrives as its time comes.
    fn learn_due(cache: &LatestCache, s: &GpuSampleRow) -> bool {
        learn_due_at(cache, s, s.timestamp_ms)
    }

    fn learn_due_at(cache: &LatestCache, s: &GpuSampleRow, now_ms: i64) -> bool {
        let due = cache.due(&[s], now_ms);
        cache.learn(&[s], &due, now_ms);
        due.iter().any(|d| d.device_id == s.device_id)
    }

    #[test]
    fn a_quiet_device_gets_its_last_sample_written() {
        let cache = LatestCache::default();
        let mut other = sample(10_000, GIB);
        other.device_id = 9;
        learn_due(&cache, &sample(10_000, 40 * GIB));
        learn_due(&cache, &other);
        learn_due(&cache, &sample(11_000, 40 * GIB + 2));
        // Device 3 goes quiet; device 9 keeps reporting.
        for ts in (11_000..16_000).step_by(1000) {
            other.timestamp_ms = ts;
            let due = cache.due(&[&other], ts);
            assert!(
                !due.iter().any(|d| d.device_id == 3),
                "not quiet yet at {ts}"
            );
            cache.learn(&[&other], &due, ts);
        }
        other.timestamp_ms = 16_000;
        let due = cache.due(&[&other], 16_000);
        let quiet: Vec<i64> = due
            .iter()
            .filter(|d| d.device_id == 3)
            .map(|d| d.used_last)
            .collect();
        assert_eq!(quiet, vec![40 * GIB + 2], "its newest sample, once");
        cache.learn(&[&other], &due, 16_000);
        other.timestamp_ms = 18_000;
        assert!(
            !cache
                .due(&[&other], 18_000)
                .iter()
                .any(|d| d.device_id == 3)
        );
    }

    #[test]
    fn closing_takes_every_unwritten_sample_once() {
        let cache = LatestCache::default();
        learn_due(&cache, &sample(10_000, 40 * GIB));
        assert!(cache.take_unwritten().is_empty(), "all written");
        learn_due(&cache, &sample(11_000, 40 * GIB + 2));
        let taken: Vec<i64> = cache
            .take_unwritten()
            .iter()
            .map(|s| s.timestamp_ms)
            .collect();
        assert_eq!(taken, vec![11_000]);
        assert!(cache.take_unwritten().is_empty());
    }

    #[test]
    fn a_steady_device_is_checkpointed_every_few_seconds() {
        let cache = LatestCache::default();
        assert!(learn_due(&cache, &sample(10_000, 40 * GIB)), "first sight");
        assert!(!learn_due(&cache, &sample(11_000, 40 * GIB)));
        assert!(!learn_due(&cache, &sample(14_000, 40 * GIB + GIB / 2)));
        assert!(learn_due(&cache, &sample(10_000 + CHECKPOINT_MS, 40 * GIB)));
        assert!(!learn_due(&cache, &sample(16_000, 40 * GIB)));
    }

    #[test]
    fn a_replay_is_checkpointed_by_the_wall_clock() {
        let cache = LatestCache::default();
        // Twenty seconds of samples a second of wall-clock time.
        let mut written = Vec::new();
        for i in 0..200 {
            let ts = 10_000 + i * 1000;
            if learn_due_at(&cache, &sample(ts, 40 * GIB), 10_000 + i * 50) {
                written.push(ts);
            }
        }
        assert_eq!(
            written,
            vec![10_000, 110_000],
            "first sight, then 5 s later"
        );
    }

    #[test]
    fn a_device_behind_the_others_is_not_quiet() {
        let cache = LatestCache::default();
        let mut ahead = sample(100_000, GIB);
        ahead.device_id = 9;
        learn_due_at(&cache, &ahead, 0);
        learn_due_at(&cache, &sample(10_000, 40 * GIB), 0);
        // Both replay, device 3 a minute and a half behind device 9, their
        // batches in different writes.
        for i in 1..20 {
            ahead.timestamp_ms = 100_000 + i * 1000;
            let now = i * 400;
            let due = cache.due(&[&ahead], now);
            assert!(!due.iter().any(|d| d.device_id == 3), "at {now}: {due:?}");
            cache.learn(&[&ahead], &due, now);
            let behind = sample(10_000 + i * 1000, 40 * GIB);
            let due = cache.due(&[&behind], now + 200);
            cache.learn(&[&behind], &due, now + 200);
        }
    }

    #[test]
    fn a_move_of_one_percent_is_written_at_once() {
        let cache = LatestCache::default();
        learn_due(&cache, &sample(10_000, 40 * GIB));
        assert!(learn_due(&cache, &sample(11_000, 41 * GIB)), "up 1 GiB");
        assert!(learn_due(&cache, &sample(12_000, 40 * GIB)), "back down");
        let mut spike = sample(13_000, 40 * GIB);
        spike.used_max = 60 * GIB;
        assert!(learn_due(&cache, &spike), "a peak within the interval");
    }

    #[test]
    fn the_overlay_is_the_newest_committed_sample() {
        let cache = LatestCache::default();
        assert_eq!(cache.newer_than(3, None), None, "unknown device");
        learn_due(&cache, &sample(10_000, 40 * GIB));
        learn_due(&cache, &sample(12_000, 40 * GIB + 2));
        // A replayed older sample changes nothing.
        assert!(!learn_due(&cache, &sample(9_000, 70 * GIB)));
        let overlay = cache.newer_than(3, Some(10_000)).map(|s| s.used_last);
        assert_eq!(overlay, Some(40 * GIB + 2));
        assert_eq!(cache.newer_than(3, Some(12_000)), None, "row is as new");
        assert_eq!(
            cache.newer_than(3, Some(20_000)),
            None,
            "another collector wrote a newer one"
        );
    }

    #[test]
    fn newest_per_device_keeps_one_sample_each() {
        let a = sample(1_000, 1);
        let b = sample(3_000, 2);
        let c = sample(2_000, 3);
        let mut other = sample(500, 4);
        other.device_id = 9;
        let mut newest = newest_per_device(&[&a, &b, &c, &other]);
        newest.sort_by_key(|s| s.device_id);
        let picked: Vec<(i64, i64)> = newest.iter().map(|s| (s.device_id, s.used_last)).collect();
        assert_eq!(picked, vec![(3, 2), (9, 4)]);
    }
}
