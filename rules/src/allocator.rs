//! Signals from a process's own allocator (PyTorch's caching allocator):
//! memory it holds but cannot hand out, retries of `cudaMalloc` after
//! flushing its cache, and out-of-memory errors. Counters are cumulative
//! since the process started; what matters is how they move while we watch.

use std::collections::VecDeque;

/// One report as the rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorObservation {
    pub timestamp_ms: i64,
    pub allocated: u64,
    pub reserved: u64,
    pub inactive_split: u64,
    pub peak_allocated: u64,
    pub alloc_retries: u64,
    pub ooms: u64,
}

impl AllocatorObservation {
    /// Held by the allocator, in no live tensor right now.
    pub fn fragmentation(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }

    /// Held by the allocator beyond the most its tensors ever needed at
    /// once: cache that even the job's peak leaves unused, because freed
    /// blocks are split too finely to reuse. Unlike `fragmentation`, it
    /// does not count the activations a step frees and the next one reuses.
    pub fn waste(&self) -> u64 {
        self.reserved
            .saturating_sub(self.peak_allocated.max(self.allocated))
    }

    pub fn waste_ratio(&self) -> f64 {
        if self.reserved == 0 {
            0.0
        } else {
            self.waste() as f64 / self.reserved as f64
        }
    }
}

/// The history of one process's counters the rules need.
#[derive(Debug, Default)]
pub struct AllocatorWatch {
    /// (report time, cumulative retries), oldest first, for the retry window.
    retries: VecDeque<(i64, u64)>,
    last_retry_ms: Option<i64>,
    last_ooms: Option<u64>,
    last_oom_ms: Option<i64>,
    /// OOMs seen while watching (not those before the first report).
    ooms_seen: u64,
    last: Option<AllocatorObservation>,
}

impl AllocatorWatch {
    /// An alert restored as firing after a collector restart: keep it held
    /// as if its signal was last seen when it started, instead of resolving
    /// it on the first quiet report.
    pub fn restored(retries_firing_since: Option<i64>, oom_firing_since: Option<i64>) -> Self {
        Self {
            last_retry_ms: retries_firing_since,
            last_oom_ms: oom_firing_since,
            ..Self::default()
        }
    }

    /// Takes a report; reports older than the newest one are ignored (the
    /// same report can arrive with several intervals).
    pub fn observe(&mut self, o: AllocatorObservation, retry_window_ms: i64) {
        if self.last.is_some_and(|l| o.timestamp_ms <= l.timestamp_ms) {
            return;
        }
        if let Some(&(_, before)) = self.retries.back()
            && o.alloc_retries > before
        {
            self.last_retry_ms = Some(o.timestamp_ms);
        }
        self.retries.push_back((o.timestamp_ms, o.alloc_retries));
        // Keep one point at or before the window's start as the baseline.
        while self.retries.len() > 1
            && self
                .retries
                .get(1)
                .is_some_and(|(t, _)| *t <= o.timestamp_ms - retry_window_ms)
        {
            self.retries.pop_front();
        }
        if let Some(before) = self.last_ooms
            && o.ooms > before
        {
            self.ooms_seen += o.ooms - before;
            self.last_oom_ms = Some(o.timestamp_ms);
        }
        self.last_ooms = Some(o.ooms);
        self.last = Some(o);
    }

    pub fn last(&self) -> Option<&AllocatorObservation> {
        self.last.as_ref()
    }

    /// Retries counted within the window ending at the newest report.
    pub fn retries_in_window(&self) -> u64 {
        match (self.retries.front(), self.retries.back()) {
            (Some((_, first)), Some((_, last))) => last.saturating_sub(*first),
            _ => 0,
        }
    }

    /// A retry happened within `window_ms` of `now_ms`.
    pub fn retried_within(&self, window_ms: i64, now_ms: i64) -> bool {
        self.last_retry_ms.is_some_and(|t| now_ms - t < window_ms)
    }

    /// The newest OOM, when it is less than `hold_ms` old.
    pub fn oom_within(&self, hold_ms: i64, now_ms: i64) -> Option<i64> {
        self.last_oom_ms.filter(|t| now_ms - *t < hold_ms)
    }

    pub fn ooms_seen(&self) -> u64 {
        self.ooms_seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(ts: i64, retries: u64, ooms: u64) -> AllocatorObservation {
        AllocatorObservation {
            timestamp_ms: ts,
            allocated: 10,
            reserved: 40,
            inactive_split: 5,
            peak_allocated: 25,
            alloc_retries: retries,
            ooms,
        }
    }

    #[test]
    fn counts_only_retries_inside_the_window() {
        let mut w = AllocatorWatch::default();
        // 50 retries before we started watching are history, not a signal.
        w.observe(report(0, 50, 0), 60_000);
        assert_eq!(w.retries_in_window(), 0);
        w.observe(report(30_000, 52, 0), 60_000);
        w.observe(report(60_000, 55, 0), 60_000);
        assert_eq!(w.retries_in_window(), 5);
        // The baseline moves: at 120 s only the retries since 60 s count.
        w.observe(report(90_000, 55, 0), 60_000);
        w.observe(report(120_000, 56, 0), 60_000);
        assert_eq!(w.retries_in_window(), 1);
        assert!(w.retried_within(60_000, 150_000));
        assert!(!w.retried_within(60_000, 180_000));
    }

    #[test]
    fn an_oom_counts_from_when_it_happens_and_replays_are_ignored() {
        let mut w = AllocatorWatch::default();
        w.observe(report(0, 0, 2), 60_000);
        assert_eq!(w.oom_within(600_000, 0), None, "OOMs before watching");
        w.observe(report(1_000, 0, 3), 60_000);
        w.observe(report(1_000, 0, 3), 60_000);
        w.observe(report(500, 0, 9), 60_000);
        assert_eq!(w.ooms_seen(), 1);
        assert_eq!(w.oom_within(600_000, 2_000), Some(1_000));
        assert_eq!(w.oom_within(600_000, 601_000), None);
    }

    #[test]
    fn waste_is_what_even_the_peak_left_unused() {
        let r = report(0, 0, 0);
        assert_eq!(r.fragmentation(), 30, "40 reserved, 10 allocated now");
        assert_eq!(r.waste(), 15, "the peak needed 25 of the 40");
        assert!((r.waste_ratio() - 0.375).abs() < 1e-9);
    }
}
