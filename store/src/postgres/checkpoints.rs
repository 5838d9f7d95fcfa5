//! Rows that hold only the newest of something, rewritten as checkpoints:
//! each device's `gpu_latest` row (what the fleet overview reads), each
//! node's last-seen time, each process's last-seen time and memory, and
//! each process's newest allocator report. For every key this remembers
//! the newest value this collector committed and what it last wrote to the
//! row.
//!
//! Rewriting such a row costs Postgres about as much as inserting the
//! sample did, and every GPU sends one a second; so the row is a
//! checkpoint, rewritten when the value moved far enough that a reader of
//! the row alone should see it now (for a GPU, memory by 1 % of its total;
//! for a process, memory by a sixteenth), or at least every
//! [`Checkpoint::EVERY_MS`] of wall-clock time (5 s for devices and nodes,
//! 10 s for processes). This collector's reads lay its
//! newest committed values over the rows, so for the agents it serves they
//! are current to the second; another collector on the same database sees
//! a steady row at most that late. A key that stops reporting gets its last
//! value written once no newer one has come for that long (while other keys
//! keep this collector writing) or when the collector closes; a collector
//! that dies leaves rows up to that far behind.
//!
//! The pace is the wall clock's, not the samples': agents replaying a spool
//! send many seconds of samples a second, and neither their steady devices
//! nor the devices of agents that lag behind the others are rewritten any
//! more often for it.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::model::{AllocatorRow, GpuSampleRow};

/// A steady device's or node's row trails its newest value by at most this
/// much wall-clock time.
pub(super) const CHECKPOINT_MS: i64 = 5_000;

/// How often, in wall-clock time, entries are scanned for quiet keys.
const QUIET_SCAN_EVERY_MS: i64 = 1_000;

/// Entries with no new value for this long are forgotten (the device went
/// away or its agent moved to another collector).
pub(super) const FORGET_AFTER_MS: i64 = 10 * 60_000;

/// A value whose row is checkpointed.
pub(super) trait Checkpoint: Copy {
    /// A steady row is rewritten at least this often (wall-clock time).
    const EVERY_MS: i64 = CHECKPOINT_MS;
    /// The row it goes to.
    fn key(&self) -> i64;
    /// When it was sampled: a row never goes back to an older value.
    fn timestamp_ms(&self) -> i64;
    /// True when it differs from `written`, what the row holds, enough that
    /// a reader of the row alone should see it at once. By default only
    /// the pace rewrites a row.
    fn moved_from(&self, _written: &Self) -> bool {
        false
    }
}

impl Checkpoint for GpuSampleRow {
    fn key(&self) -> i64 {
        self.device_id
    }

    fn timestamp_ms(&self) -> i64 {
        self.timestamp_ms
    }

    /// Memory moved by 1 % of the device's total, or the device changed.
    fn moved_from(&self, written: &Self) -> bool {
        let step = self.total.max(written.total) / 100;
        self.used_last.abs_diff(written.used_last) >= step.unsigned_abs()
            || self.used_max.abs_diff(written.used_max) >= step.unsigned_abs()
            || self.total != written.total
            || self.reserved != written.reserved
    }
}

/// A node's newest sample time: its `nodes.last_seen_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct NodeSeen {
    pub(super) node_id: i64,
    pub(super) timestamp_ms: i64,
}

impl Checkpoint for NodeSeen {
    fn key(&self) -> i64 {
        self.node_id
    }

    fn timestamp_ms(&self) -> i64 {
        self.timestamp_ms
    }
}

/// A steady process's newest sample: its row's `last_seen_ms` and
/// `memory_last`. (A process with a new peak or attribution has its whole
/// row upserted at once instead.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ProcessSeen {
    pub(super) process_id: i64,
    pub(super) timestamp_ms: i64,
    pub(super) memory: i64,
}

/// How far a steady process's row (its last-seen checkpoint) may trail its
/// newest sample: the checkpoint is written at least every
/// [`ProcessSeen::EVERY_MS`] of wall-clock time, and this leaves room for
/// batches that arrive late. A process chart asks for the device's
/// processes whose row was seen this long before its start, rather than
/// sending the ids of every process this collector saw (200,000 at
/// 100,000 GPUs, which cost a chart 230 ms); those without samples in the
/// range drop out.
pub(super) const PROCESS_ROW_TRAILS_MS: i64 = 6 * ProcessSeen::EVERY_MS;

impl Checkpoint for ProcessSeen {
    /// The dashboard lists the processes seen in the last 30 s.
    const EVERY_MS: i64 = 10_000;

    fn key(&self) -> i64 {
        self.process_id
    }

    fn timestamp_ms(&self) -> i64 {
        self.timestamp_ms
    }

    /// Memory moved by a sixteenth of the larger value: a job that grows
    /// or sheds a real share of its memory shows at once on every
    /// collector's list, while one that wobbles by a few megabytes a
    /// second (most do, between the allocator's growth steps) rewrites its
    /// row at the pace alone. A new peak upserts the whole row anyway.
    fn moved_from(&self, written: &Self) -> bool {
        moved_by_a_sixteenth(self.memory, written.memory)
    }
}

/// True when `now` differs from `then` by at least a sixteenth of the
/// larger of the two.
fn moved_by_a_sixteenth(now: i64, then: i64) -> bool {
    now != then && now.abs_diff(then) >= now.unsigned_abs().max(then.unsigned_abs()) / 16
}

/// A process's newest allocator report: the `alloc_*` columns of its row,
/// which the process list and the job pages read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AllocatorSeen {
    pub(super) process_id: i64,
    pub(super) report: AllocatorRow,
}

impl Checkpoint for AllocatorSeen {
    /// As the process's last-seen time: the reports come every second and
    /// copying each onto the row was a third of the rewrites of
    /// `processes` on the demo fleet.
    const EVERY_MS: i64 = ProcessSeen::EVERY_MS;

    fn key(&self) -> i64 {
        self.process_id
    }

    fn timestamp_ms(&self) -> i64 {
        self.report.timestamp_ms
    }

    /// A new OOM or allocator retry, a part counted or dropped, or
    /// allocated or reserved memory moved by a sixteenth: what an operator
    /// reading the list would want at once.
    fn moved_from(&self, written: &Self) -> bool {
        let (now, then) = (&self.report, &written.report);
        let counted = |r: &AllocatorRow| r.parts().map(|(bytes, _)| bytes.is_some());
        now.ooms != then.ooms
            || now.alloc_retries != then.alloc_retries
            || counted(now) != counted(then)
            || moved_by_a_sixteenth(now.allocated, then.allocated)
            || moved_by_a_sixteenth(now.reserved, then.reserved)
    }
}

#[derive(Debug, Clone, Copy)]
struct Known<V> {
    /// The newest committed value.
    newest: V,
    /// When (wall clock) `newest` became the newest.
    newest_at_ms: i64,
    /// What the database row holds, as far as this collector wrote it.
    checkpoint: V,
    /// When (wall clock) `checkpoint` was written.
    checkpoint_at_ms: i64,
}

#[derive(Debug)]
pub(super) struct Checkpoints<V> {
    inner: Mutex<Inner<V>>,
}

/// The `gpu_latest` checkpoints.
pub(super) type LatestCache = Checkpoints<GpuSampleRow>;
/// The nodes' last-seen checkpoints.
pub(super) type NodeCache = Checkpoints<NodeSeen>;
/// The steady processes' last-seen checkpoints.
pub(super) type ProcessSeenCache = Checkpoints<ProcessSeen>;
/// The processes' newest allocator reports.
pub(super) type AllocatorSeenCache = Checkpoints<AllocatorSeen>;

impl<V> Default for Checkpoints<V> {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                known: HashMap::new(),
                quiet_scan_ms: 0,
                size_after_sweep: 0,
                logs_changes: false,
                changed: VecDeque::new(),
                changed_dropped: 0,
            }),
        }
    }
}

impl<V> Checkpoints<V> {
    /// Checkpoints that log each new newest value, for a reader that lays
    /// them over rows it keeps ([`Self::lay_changed_over`]).
    pub(super) fn logging_changes() -> Self {
        let checkpoints = Self::default();
        if let Ok(mut inner) = checkpoints.inner.lock() {
            inner.logs_changes = true;
        }
        checkpoints
    }
}

#[derive(Debug)]
struct Inner<V> {
    known: HashMap<i64, Known<V>>,
    /// When quiet keys were last looked for.
    quiet_scan_ms: i64,
    size_after_sweep: usize,
    /// Whether `changed` is kept.
    logs_changes: bool,
    /// Each new newest value, oldest first, so that a reader that laid the
    /// newest values over its rows need lay over only those that came
    /// since, and can copy them out rather than look each key up under the
    /// lock the writers share. Bounded: the oldest half goes when it
    /// outgrows twice the keys.
    changed: VecDeque<V>,
    /// How many values were dropped from the front of `changed`.
    changed_dropped: u64,
}

impl<V: Copy> Inner<V> {
    /// Where the log of changes stands now.
    fn changed_through(&self) -> u64 {
        self.changed_dropped + self.changed.len() as u64
    }

    fn log_change(&mut self, newest: V) {
        if !self.logs_changes {
            return;
        }
        if self.changed.len() >= (self.known.len() * 2).max(MIN_CHANGE_LOG) {
            let half = self.changed.len() / 2;
            self.changed.drain(..half);
            self.changed_dropped += half as u64;
        }
        self.changed.push_back(newest);
    }
}

/// The change log keeps at least this many values, however few keys are
/// known.
const MIN_CHANGE_LOG: usize = 4096;

impl<V: Checkpoint> Known<V> {
    fn unwritten(&self) -> bool {
        self.newest.timestamp_ms() > self.checkpoint.timestamp_ms()
    }
}

impl<V: Checkpoint> Checkpoints<V> {
    /// What this transaction writes at wall-clock time `now_ms`: the values
    /// of `newest` (one per key, its newest in the group) that are due,
    /// and about once a second the unwritten newest values of keys that
    /// went quiet. One per key, in key order.
    pub(super) fn due(&self, newest: &[&V], now_ms: i64) -> Vec<V> {
        let Ok(mut inner) = self.inner.lock() else {
            return newest.iter().map(|v| **v).collect();
        };
        let mut due: Vec<V> = newest
            .iter()
            .filter(|value| match inner.known.get(&value.key()) {
                None => true,
                Some(known) => {
                    value.timestamp_ms() > known.checkpoint.timestamp_ms()
                        && (now_ms >= known.checkpoint_at_ms + V::EVERY_MS
                            || value.moved_from(&known.checkpoint))
                }
            })
            .map(|value| **value)
            .collect();
        if now_ms >= inner.quiet_scan_ms + QUIET_SCAN_EVERY_MS {
            inner.quiet_scan_ms = now_ms;
            let quiet_before = now_ms - V::EVERY_MS;
            let in_group = |key: i64| newest.iter().any(|v| v.key() == key);
            due.extend(
                inner
                    .known
                    .values()
                    .filter(|k| k.unwritten() && k.newest_at_ms <= quiet_before)
                    .filter(|k| !in_group(k.newest.key()))
                    .map(|k| k.newest),
            );
        }
        due.sort_unstable_by_key(Checkpoint::key);
        due
    }

    /// Every newest value not yet in its row, for a collector that is
    /// closing; they count as written from here on.
    pub(super) fn take_unwritten(&self) -> Vec<V> {
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
        unwritten.sort_unstable_by_key(Checkpoint::key);
        unwritten
    }

    /// After the commit at wall-clock time `now_ms`: `newest` were
    /// committed, `written` (a subset) also went to their rows.
    pub(super) fn learn(&self, newest: &[&V], written: &[V], now_ms: i64) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        for value in newest {
            match inner.known.get_mut(&value.key()) {
                Some(known) => {
                    if value.timestamp_ms() > known.newest.timestamp_ms() {
                        known.newest = **value;
                        known.newest_at_ms = now_ms;
                        inner.log_change(**value);
                    }
                }
                None => {
                    // Only a value written to the row may start an entry:
                    // the checkpoint must be something the row holds.
                    if written.iter().any(|w| w.key() == value.key()) {
                        inner.known.insert(
                            value.key(),
                            Known {
                                newest: **value,
                                newest_at_ms: now_ms,
                                checkpoint: **value,
                                checkpoint_at_ms: now_ms,
                            },
                        );
                        inner.log_change(**value);
                    }
                }
            }
        }
        for value in written {
            if let Some(known) = inner.known.get_mut(&value.key())
                && value.timestamp_ms() >= known.checkpoint.timestamp_ms()
            {
                known.checkpoint = *value;
                known.checkpoint_at_ms = now_ms;
            }
        }
        if inner.known.len() > inner.size_after_sweep * 2 + 1024 {
            let cutoff = now_ms - FORGET_AFTER_MS;
            inner.known.retain(|_, k| k.newest_at_ms >= cutoff);
            inner.size_after_sweep = inner.known.len();
        }
    }

    /// The keys whose newest committed value is at `since_ms` or later
    /// while their row, as this collector last wrote it, holds an older
    /// one: those a read of the rows seen since then would miss. A steady
    /// key's row trails by a checkpoint period, so for a window longer than
    /// that these are few (keys of an agent that just replayed its spool),
    /// not every key this collector serves.
    pub(super) fn seen_since_beyond_rows(&self, since_ms: i64) -> Vec<i64> {
        let Ok(inner) = self.inner.lock() else {
            return Vec::new();
        };
        inner
            .known
            .iter()
            .filter(|(_, k)| {
                k.newest.timestamp_ms() >= since_ms && k.checkpoint.timestamp_ms() < since_ms
            })
            .map(|(key, _)| *key)
            .collect()
    }

    /// Lays over each of `rows` (the row of the key `keys` gives in the
    /// same place) the newest committed value of its key, where that is
    /// newer: one lock for a whole fleet. Returns the change log's
    /// position for [`Self::lay_changed_over`].
    pub(super) fn lay_newest_over(
        &self,
        keys: impl Iterator<Item = i64>,
        rows: &mut [Option<V>],
    ) -> Option<u64> {
        let inner = self.inner.lock().ok()?;
        for (key, row) in keys.zip(rows) {
            if let Some(known) = inner.known.get(&key) {
                lay_over(known.newest, row);
            }
        }
        Some(inner.changed_through())
    }

    /// Brings `rows`, over which the newest values were laid at the change
    /// log's position `since`, up to date: lays over them the newest value
    /// of each key that changed since (`slot_of` says which row is a key's,
    /// if any). Returns the log's new position, or `None` where the log no
    /// longer reaches back to `since`: then only [`Self::lay_newest_over`]
    /// brings them up to date.
    pub(super) fn lay_changed_over(
        &self,
        since: u64,
        slot_of: impl Fn(i64) -> Option<usize>,
        rows: &mut [Option<V>],
    ) -> Option<u64> {
        let (changed, through) = {
            let inner = self.inner.lock().ok()?;
            if !inner.logs_changes {
                return None;
            }
            let from = usize::try_from(since.checked_sub(inner.changed_dropped)?).ok()?;
            if from > inner.changed.len() {
                return None;
            }
            let changed: Vec<V> = inner.changed.range(from..).copied().collect();
            (changed, inner.changed_through())
        };
        for newest in changed {
            if let Some(row) = slot_of(newest.key()).and_then(|slot| rows.get_mut(slot)) {
                lay_over(newest, row);
            }
        }
        Some(through)
    }

    /// The newest committed value of `key` if it is newer than `row_ms`,
    /// the time of the value its row holds.
    pub(super) fn newer_than(&self, key: i64, row_ms: Option<i64>) -> Option<V> {
        let inner = self.inner.lock().ok()?;
        let known = inner.known.get(&key)?;
        (row_ms.is_none_or(|ms| known.newest.timestamp_ms() > ms)).then_some(known.newest)
    }
}

/// Puts `newest` in `row` where that is newer than what it holds.
fn lay_over<V: Checkpoint>(newest: V, row: &mut Option<V>) {
    if row
        .as_ref()
        .is_none_or(|r| newest.timestamp_ms() > r.timestamp_ms())
    {
        *row = Some(newest);
    }
}

/// One value per key: the newest of each in `values`, in key order (two
/// writers updating the same rows lock them in the same order).
pub(super) fn newest_per_key<'r, V: Checkpoint>(values: &[&'r V]) -> Vec<&'r V> {
    let mut newest: HashMap<i64, &V> = HashMap::with_capacity(values.len());
    for value in values {
        let entry = newest.entry(value.key()).or_insert(value);
        if entry.timestamp_ms() < value.timestamp_ms() {
            *entry = value;
        }
    }
    let mut newest: Vec<&V> = newest.into_values().collect();
    newest.sort_unstable_by_key(|v| v.key());
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

    /// Whether `value` is due at `now_ms`, learning it as committed (and
    /// written where due).
    fn learn_due_at<V: Checkpoint>(cache: &Checkpoints<V>, value: &V, now_ms: i64) -> bool {
        let due = cache.due(&[value], now_ms);
        cache.learn(&[value], &due, now_ms);
        due.iter().any(|d| d.key() == value.key())
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
    fn rows_laid_over_once_need_only_the_devices_that_changed_since() {
        let cache = LatestCache::logging_changes();
        let on = |device_id: i64, ts: i64| GpuSampleRow {
            device_id,
            ..sample(ts, GIB)
        };
        for device_id in 0..3 {
            learn_due(&cache, &on(device_id, 10_000));
        }
        let mut rows = vec![None; 3];
        let since = cache.lay_newest_over(0..3, &mut rows).unwrap();
        let times = |rows: &[Option<GpuSampleRow>]| -> Vec<Option<i64>> {
            rows.iter().map(|r| r.map(|r| r.timestamp_ms)).collect()
        };
        assert_eq!(times(&rows), [Some(10_000); 3]);
        learn_due(&cache, &on(1, 11_000));
        learn_due(&cache, &on(7, 11_000)); // not in these rows
        // A row newer than the checkpoints (another collector's) stays.
        rows[2] = Some(on(2, 12_000));
        let slot_of = |device_id: i64| usize::try_from(device_id).ok().filter(|&s| s < 3);
        let since = cache.lay_changed_over(since, slot_of, &mut rows).unwrap();
        assert_eq!(times(&rows), [Some(10_000), Some(11_000), Some(12_000)]);
        learn_due(&cache, &on(2, 13_000));
        let mut fresh = rows.clone();
        let through = cache.lay_changed_over(since, slot_of, &mut rows).unwrap();
        cache.lay_newest_over(0..3, &mut fresh);
        assert_eq!(rows, fresh, "as if every device had been laid over");
        // Once the log outgrows the keys, its oldest part goes, and a
        // reader from before it must lay every device over again.
        for ts in (20_000..).step_by(1000).take(MIN_CHANGE_LOG) {
            learn_due(&cache, &on(0, ts));
        }
        assert_eq!(cache.lay_changed_over(through, slot_of, &mut rows), None);
        let unlogged = LatestCache::default();
        learn_due(&unlogged, &on(0, 10_000));
        let since = unlogged.lay_newest_over(0..3, &mut rows).unwrap();
        assert_eq!(
            unlogged.lay_changed_over(since, slot_of, &mut rows),
            None,
            "checkpoints that keep no log"
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
    fn only_keys_whose_rows_trail_the_window_go_by_id() {
        let cache = LatestCache::default();
        // Steady and live: the row trails the newest sample by under 5 s.
        for ts in (10_000..=40_000).step_by(1000) {
            learn_due(&cache, &sample(ts, 40 * GIB));
        }
        assert!(cache.seen_since_beyond_rows(30_000).is_empty());
        // Replayed at a minute of samples a second: the row, written by the
        // wall clock, is now far behind the newest sample.
        let mut replayed = sample(50_000, GIB);
        replayed.device_id = 9;
        learn_due_at(&cache, &replayed, 41_000);
        for i in 1..=60 {
            replayed.timestamp_ms = 50_000 + i * 1000;
            learn_due_at(&cache, &replayed, 41_000 + i * 16);
        }
        assert_eq!(cache.seen_since_beyond_rows(100_000), vec![9]);
        assert!(
            cache.seen_since_beyond_rows(111_000).is_empty(),
            "none seen"
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
    fn newest_per_key_keeps_one_sample_each() {
        let a = sample(1_000, 1);
        let b = sample(3_000, 2);
        let c = sample(2_000, 3);
        let mut other = sample(500, 4);
        other.device_id = 9;
        let mut newest = newest_per_key(&[&a, &b, &c, &other]);
        newest.sort_by_key(|s| s.device_id);
        let picked: Vec<(i64, i64)> = newest.iter().map(|s| (s.device_id, s.used_last)).collect();
        assert_eq!(picked, vec![(3, 2), (9, 4)]);
    }

    #[test]
    fn a_process_wobbling_under_its_peak_is_written_at_the_pace_and_a_real_move_at_once() {
        let cache = ProcessSeenCache::default();
        let seen = |ts: i64, memory: i64| ProcessSeen {
            process_id: 5,
            timestamp_ms: ts,
            memory,
        };
        assert!(learn_due_at(&cache, &seen(0, 10 * GIB), 0), "first sight");
        for s in 1..10 {
            let wobble = 10 * GIB - s * (8 << 20);
            assert!(
                !learn_due_at(&cache, &seen(s * 1000, wobble), s * 1000),
                "{s} s: a few MiB"
            );
        }
        assert!(
            learn_due_at(&cache, &seen(10_000, 10 * GIB), 10_000),
            "10 s on"
        );
        assert!(
            !learn_due_at(&cache, &seen(11_000, 10 * GIB - GIB / 17), 11_000),
            "under a sixteenth"
        );
        assert!(
            learn_due_at(&cache, &seen(12_000, 10 * GIB - GIB), 12_000),
            "a tenth down"
        );
        assert!(learn_due_at(&cache, &seen(13_000, 0), 13_000), "all freed");
        assert!(
            learn_due_at(&cache, &seen(14_000, 1 << 20), 14_000),
            "from nothing"
        );
    }

    #[test]
    fn an_allocator_report_is_written_at_the_pace_or_when_it_counts_something_new() {
        let cache = AllocatorSeenCache::default();
        let report = |ts: i64, allocated: i64, ooms: i64, retries: i64| AllocatorSeen {
            process_id: 5,
            report: AllocatorRow {
                timestamp_ms: ts,
                allocated,
                reserved: 12 * GIB,
                active: allocated,
                inactive_split: 0,
                peak_allocated: 11 * GIB,
                alloc_retries: retries,
                ooms,
                composition: None,
            },
        };
        assert!(learn_due_at(&cache, &report(0, 8 * GIB, 0, 0), 0), "first");
        assert!(
            !learn_due_at(&cache, &report(1000, 8 * GIB + (64 << 20), 0, 0), 1000),
            "64 MiB more allocated"
        );
        assert!(
            learn_due_at(&cache, &report(2000, 8 * GIB, 0, 1), 2000),
            "a retry"
        );
        assert!(
            learn_due_at(&cache, &report(3000, 8 * GIB, 1, 1), 3000),
            "an OOM"
        );
        assert!(
            learn_due_at(&cache, &report(4000, 10 * GIB, 1, 1), 4000),
            "a quarter more allocated"
        );
        assert!(
            !learn_due_at(&cache, &report(5000, 10 * GIB, 1, 1), 13_999),
            "steady, 9.999 s on"
        );
        assert!(
            learn_due_at(&cache, &report(6000, 10 * GIB, 1, 1), 14_000),
            "steady, 10 s on"
        );
        assert_eq!(
            cache
                .newer_than(5, Some(5000))
                .map(|r| r.report.timestamp_ms),
            Some(6000),
            "the newest committed report, for a read of the row"
        );
        let mut counted = report(7000, 10 * GIB, 1, 1);
        counted.report.composition = Some(headroom_common::Composition::default());
        assert!(
            !learn_due_at(&cache, &counted, 14_500),
            "nothing counted yet"
        );
        let mut weights = report(8000, 10 * GIB, 1, 1);
        weights.report.composition = Some(headroom_common::Composition {
            weights: Some(headroom_common::Part {
                bytes: 6 << 30,
                dtype: headroom_common::Dtype::Bfloat16,
            }),
            ..headroom_common::Composition::default()
        });
        assert!(learn_due_at(&cache, &weights, 15_000), "weights counted");
    }
}
