//! Signals from a process's own allocator (PyTorch's caching allocator):
//! memory it holds but cannot hand out, retries of `cudaMalloc` after
//! flushing its cache, and out-of-memory errors. Counters are cumulative
//! since the process started; what matters is how they move while we watch,
//! which the rules that read them (`rules/fragmentation.rs`,
//! `rules/alloc_retries.rs`, `rules/allocator_oom.rs`) track themselves.

use headroom_common::Breakdown;
use headroom_common::composition::{AllocatorFigures, Composition};

/// A report older than this no longer speaks for the process now: the
/// client stopped reporting, and what it last said holds no alert up.
pub(crate) const REPORT_STALE_MS: i64 = 60_000;

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
    /// What the job counted in its weights, gradients and optimizer state.
    pub composition: Option<Composition>,
}

impl AllocatorObservation {
    /// Where the process's memory goes at its peak, when the job counts its
    /// parts; `driver_used` is what NVML says the process holds.
    pub fn breakdown(&self, driver_used: u64) -> Option<Breakdown> {
        self.composition.filter(|c| !c.is_empty()).map(|c| {
            Breakdown::of(
                &c,
                AllocatorFigures {
                    allocated: self.allocated,
                    reserved: self.reserved,
                    peak_allocated: self.peak_allocated,
                },
                Some(driver_used),
            )
        })
    }

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

#[cfg(test)]
mod tests {
    use crate::engine_fixtures::report;

    #[test]
    fn waste_is_what_even_the_peak_left_unused() {
        let r = report(0, 0, 0);
        assert_eq!(r.fragmentation(), 30, "40 reserved, 10 allocated now");
        assert_eq!(r.waste(), 15, "the peak needed 25 of the 40");
        assert!((r.waste_ratio() - 0.375).abs() < 1e-9);
    }
}
