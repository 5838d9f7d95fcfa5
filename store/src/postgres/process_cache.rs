//! What this collector knows of each process's row, so that a steady
//! process's samples go straight into the open chunks (or `process_samples`)
//! by id, without rewriting its row (a new row version and three index
//! entries) and without looking its id up, every second. A process is
//! steady while it sets no new peak, is not seen earlier than its row
//! says, and keeps its attribution; its memory may move. Its last-seen time
//! and memory are then a checkpoint (`checkpoints::ProcessSeen`), written
//! at a pace or when memory moved far. The database stays the truth:
//! peaks and first-seen times here are ones the row already has or beats
//! (peaks only grow, last-seen times only move forward), so a stale entry
//! costs at worst a write that was not needed, never a lost peak. The last
//! memory value is the exception (another collector may have written a
//! different one since), so every checkpoint of a steady process writes
//! its memory too.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::model::ProcessSampleRow;

/// Entries with no sample for this long (of sample time) are forgotten.
const FORGET_AFTER_MS: i64 = 10 * 60_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct ProcessKey {
    device_id: i64,
    pid: i64,
    start_time_ms: i64,
}

impl ProcessKey {
    pub(super) fn of(row: &ProcessSampleRow) -> Self {
        Self {
            device_id: row.device_id,
            pid: row.pid,
            start_time_ms: row.start_time_ms,
        }
    }

    pub(super) fn new(device_id: i64, pid: i64, start_time_ms: i64) -> Self {
        Self {
            device_id,
            pid,
            start_time_ms,
        }
    }
}

/// What a sample needs done to its process's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowState {
    /// Unknown here, or something on the row changed: upserted, which
    /// returns the row's id.
    Upsert,
    /// Nothing but the last-seen time moves (a checkpoint): the sample goes
    /// in by the row's id.
    Steady(i64),
}

#[derive(Debug, Clone)]
struct Written {
    id: i64,
    first_seen_ms: i64,
    /// The newest sample committed (the row may trail it: a checkpoint).
    last_seen_ms: i64,
    memory_peak: i64,
    attribution: Attribution,
}

/// Who a process belongs to, as its row holds it: compared field by field
/// with every sample (cheaper than hashing them, and never mistaken).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Attribution {
    name: String,
    uid: i64,
    user: String,
    container_id: String,
    pod_uid: String,
    slurm_job_id: String,
    container_runtime: String,
    pod_qos_class: String,
}

impl Attribution {
    fn of(row: &ProcessSampleRow) -> Self {
        Self {
            name: row.name.clone(),
            uid: row.uid,
            user: row.user.clone(),
            container_id: row.container_id.clone(),
            pod_uid: row.pod_uid.clone(),
            slurm_job_id: row.slurm_job_id.clone(),
            container_runtime: row.container_runtime.clone(),
            pod_qos_class: row.pod_qos_class.clone(),
        }
    }

    fn matches(&self, row: &ProcessSampleRow) -> bool {
        self.uid == row.uid
            && self.name == row.name
            && self.user == row.user
            && self.container_id == row.container_id
            && self.pod_uid == row.pod_uid
            && self.slurm_job_id == row.slurm_job_id
            && self.container_runtime == row.container_runtime
            && self.pod_qos_class == row.pod_qos_class
    }
}

#[derive(Debug, Default)]
pub(super) struct ProcessCache {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    written: HashMap<ProcessKey, Written>,
    newest_ms: i64,
    size_after_sweep: usize,
}

impl ProcessCache {
    /// What each sample needs done to its process's row.
    pub(super) fn states(&self, rows: &[&ProcessSampleRow]) -> Vec<RowState> {
        let Ok(inner) = self.inner.lock() else {
            return vec![RowState::Upsert; rows.len()];
        };
        rows.iter()
            .map(|row| {
                let Some(known) = inner.written.get(&ProcessKey::of(row)) else {
                    return RowState::Upsert;
                };
                let same = row.used_max <= known.memory_peak
                    && row.timestamp_ms >= known.first_seen_ms
                    && known.attribution.matches(row);
                if !same {
                    RowState::Upsert
                } else {
                    RowState::Steady(known.id)
                }
            })
            .collect()
    }

    /// After the commit: every committed sample with its row id. An
    /// upserted one is what its row now holds at least; a steady one moves
    /// only the newest sample's time.
    pub(super) fn learn(&self, committed: &[(i64, &ProcessSampleRow)]) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        for (id, row) in committed {
            let entry = inner
                .written
                .entry(ProcessKey::of(row))
                .or_insert_with(|| Written {
                    id: *id,
                    first_seen_ms: row.timestamp_ms,
                    last_seen_ms: row.timestamp_ms,
                    memory_peak: row.used_max,
                    attribution: Attribution::of(row),
                });
            entry.id = *id;
            entry.first_seen_ms = entry.first_seen_ms.min(row.timestamp_ms);
            entry.memory_peak = entry.memory_peak.max(row.used_max);
            if !entry.attribution.matches(row) {
                entry.attribution = Attribution::of(row);
            }
            entry.last_seen_ms = entry.last_seen_ms.max(row.timestamp_ms);
            inner.newest_ms = inner.newest_ms.max(row.timestamp_ms);
        }
        if inner.written.len() > inner.size_after_sweep * 2 + 1024 {
            let cutoff = inner.newest_ms - FORGET_AFTER_MS;
            inner.written.retain(|_, w| w.last_seen_ms >= cutoff);
            inner.size_after_sweep = inner.written.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ts: i64, used: i64) -> ProcessSampleRow {
        ProcessSampleRow {
            device_id: 1,
            timestamp_ms: ts,
            pid: 42,
            start_time_ms: 0,
            used_last: used,
            used_max: used,
            name: "python".into(),
            uid: 1000,
            user: "alice".into(),
            ..ProcessSampleRow::default()
        }
    }

    #[test]
    fn only_a_change_rewrites_a_process_row() {
        let cache = ProcessCache::default();
        let first = sample(1_000, 100);
        assert_eq!(
            cache.states(&[&first]),
            vec![RowState::Upsert],
            "unknown yet"
        );
        cache.learn(&[(7, &first)]);
        let same = sample(2_000, 100);
        assert_eq!(cache.states(&[&same]), vec![RowState::Steady(7)]);
        assert_eq!(
            cache.states(&[&sample(60_000, 100)]),
            vec![RowState::Steady(7)],
            "only its last-seen time moves, a checkpoint"
        );
        let grew = sample(3_000, 150);
        assert_eq!(cache.states(&[&grew]), vec![RowState::Upsert], "new peak");
        assert_eq!(
            cache.states(&[&sample(3_000, 50)]),
            vec![RowState::Steady(7)],
            "memory that moves under the peak is a checkpoint's"
        );
        let older = sample(500, 50);
        assert_eq!(
            cache.states(&[&older]),
            vec![RowState::Upsert],
            "earlier first seen"
        );
        let mut moved = sample(3_000, 100);
        moved.container_id = "c0ffee".into();
        assert_eq!(
            cache.states(&[&moved]),
            vec![RowState::Upsert],
            "new attribution"
        );
    }

    #[test]
    fn learning_keeps_the_peak_whatever_the_order() {
        let cache = ProcessCache::default();
        let peak = sample(1_000, 300);
        let later = sample(2_000, 100);
        cache.learn(&[(7, &later), (7, &peak)]);
        // The peak of 300 is known though it came last.
        assert_eq!(
            cache.states(&[&sample(2_500, 100)]),
            vec![RowState::Steady(7)]
        );
        let mut under_peak = sample(2_500, 100);
        under_peak.used_max = 250;
        assert_eq!(cache.states(&[&under_peak]), vec![RowState::Steady(7)]);
    }
}
