//! Allocation retries: a process whose caching allocator failed a
//! `cudaMalloc`, flushed its cache and retried. Each retry stalls the step,
//! and the next failure is an out-of-memory error: this is the last warning
//! before a crash, and only the allocator's report shows it.
//!
//! The counter is cumulative since the process started, so what counts is
//! how many retries happened within the window while we watched; retries
//! from before the first report are history. Once raised, the alert holds
//! until a whole window passes without a retry, even if the process stops
//! reporting meanwhile: a job at the edge retries in bursts, and a quiet
//! report between two bursts is not a recovery.

use std::collections::VecDeque;

use headroom_common::Breakdown;

use crate::alert::{Alert, Message};
use crate::allocator::AllocatorObservation;
use crate::config::{RulesConfig, Severity};
use crate::describe::{device_name, minutes, process_name};
use crate::observation::ProcessObservation;
use crate::remedy::{self, CUT_THE_PEAK, EXPANDABLE_SEGMENTS};
use crate::rule::{ProcessFacts, ProcessRule, Start};
use crate::rules::fragmentation;

#[derive(Debug)]
pub(crate) struct AllocRetries {
    watch: RetryWatch,
}

impl ProcessRule for AllocRetries {
    fn start(start: &Start<'_, ProcessObservation<'_>>) -> Self {
        Self {
            watch: RetryWatch::restored(start.restored_at_ms),
        }
    }

    fn observe(
        &mut self,
        config: &RulesConfig,
        o: &ProcessObservation<'_>,
        facts: &ProcessFacts,
        alert: &mut Alert<'_>,
    ) {
        let r = &config.alloc_retries;
        if let Some(a) = o.allocator {
            self.watch.observe(a, r.window.ms());
        }
        if !r.enabled {
            return;
        }
        let now = o.timestamp_ms;
        let held = alert.is_active();
        // Counts from a report that stopped coming say nothing about now.
        let recent = if facts.report.is_some() {
            self.watch.retries_in_window()
        } else {
            0
        };
        let condition = (recent >= u64::from(r.min_retries)
            || (held && self.watch.retried_within(r.window.ms(), now)))
        .then_some(Severity::Warning);
        let total = facts.last_report.map_or(0, |a| a.alloc_retries);
        let labels = alert.labels();
        alert.step_with_remedy(
            now,
            condition,
            0,
            || match condition {
                Some(_) => Message::new(
                    format!(
                        "{} on {}: the allocator flushed its cache and retried cudaMalloc {recent} times in the last {} ({total} since the process started); it is at the edge of OOM",
                        process_name(labels),
                        device_name(labels),
                        minutes(r.window.ms()),
                    ),
                    serde_json::json!({ "retries_in_window": recent, "window_ms": r.window.ms(), "alloc_retries": total }),
                ),
                None => Message::new(
                    format!(
                        "{} has not retried an allocation for {}",
                        process_name(labels),
                        minutes(r.window.ms())
                    ),
                    serde_json::json!({ "alloc_retries": total }),
                ),
            },
            || {
                remedy(
                    fragmentation::is_fragmented(facts.report, config),
                    facts.breakdown(o).as_ref(),
                )
            },
        );
    }
}

/// The allocator flushed its cache and retried `cudaMalloc`: the job is at
/// the edge of its memory.
fn remedy(fragmented: bool, breakdown: Option<&Breakdown>) -> String {
    let mut text = format!(
        "Each retry frees the allocator's cache and stalls the step; the next failure is an \
         out-of-memory error. {}",
        remedy::fitting_the_largest_share(breakdown, CUT_THE_PEAK)
    );
    if fragmented && !remedy::leads_with_cache(breakdown) {
        text.push(' ');
        text.push_str("Much of the reservation is fragmented: ");
        text.push_str(EXPANDABLE_SEGMENTS);
    }
    text
}

/// The retry counter of one process as it moved while we watched.
#[derive(Debug, Default)]
struct RetryWatch {
    /// (report time, cumulative retries), oldest first, for the retry window.
    retries: VecDeque<(i64, u64)>,
    last_retry_ms: Option<i64>,
}

impl RetryWatch {
    /// An alert restored as firing after a collector restart: keep it held
    /// as if its signal was last seen when it started, instead of resolving
    /// it on the first quiet report.
    fn restored(firing_since: Option<i64>) -> Self {
        Self {
            last_retry_ms: firing_since,
            ..Self::default()
        }
    }

    /// Takes a report; reports no newer than the newest one are ignored (the
    /// same report can arrive with several intervals).
    fn observe(&mut self, o: AllocatorObservation, retry_window_ms: i64) {
        let Some(&(newest_ms, before)) = self.retries.back() else {
            self.retries.push_back((o.timestamp_ms, o.alloc_retries));
            return;
        };
        if o.timestamp_ms <= newest_ms {
            return;
        }
        if o.alloc_retries > before {
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
    }

    /// Retries counted within the window ending at the newest report.
    fn retries_in_window(&self) -> u64 {
        match (self.retries.front(), self.retries.back()) {
            (Some((_, first)), Some((_, last))) => last.saturating_sub(*first),
            _ => 0,
        }
    }

    /// A retry happened within `window_ms` of `now_ms`.
    fn retried_within(&self, window_ms: i64, now_ms: i64) -> bool {
        self.last_retry_ms.is_some_and(|t| now_ms - t < window_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alert::AlertChange;
    use crate::engine::Engine;
    use crate::engine_fixtures::report;
    use crate::engine_fixtures::{GIB, rules, stats, training, transitions};
    use crate::lifecycle::Transition;

    #[test]
    fn counts_only_retries_inside_the_window() {
        let mut w = RetryWatch::default();
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
    fn the_remedy_cuts_the_peak_and_names_fragmentation_only_when_there_is_some() {
        assert!(remedy(false, None).contains("activation checkpointing"));
        assert!(!remedy(false, None).contains("expandable_segments"));
        assert!(remedy(true, None).contains("expandable_segments"));
    }

    #[test]
    fn a_job_that_counts_its_tensors_gets_the_remedy_for_its_largest_share() {
        let b = crate::engine_fixtures::breakdown_led_by_optimizer_state();
        let text = remedy(true, Some(&b));
        assert!(text.contains("Optimizer state is 16 GiB"), "{text}");
        assert!(!text.contains("activation checkpointing"), "{text}");
        assert!(
            text.contains("expandable_segments"),
            "fragmentation still named"
        );
    }

    #[test]
    fn rising_retries_fire_and_resolve_after_a_quiet_window() {
        let mut e = Engine::new(rules("[alloc_retries]\nwindow = \"5m\"\nmin_retries = 3\n"));
        // Retries from before we watched do not count.
        let first = e.observe_process(&training(0, stats(0, 70 * GIB, 75 * GIB, 40, 0)));
        assert!(transitions(&first, "alloc_retries").is_empty());
        let mut all = Vec::new();
        for (i, retries) in [41, 42, 43].iter().enumerate() {
            let t = (i as i64 + 1) * 30_000;
            all.extend(e.observe_process(&training(t, stats(t, 70 * GIB, 75 * GIB, *retries, 0))));
        }
        let fired: Vec<&AlertChange> = all.iter().filter(|c| c.rule == "alloc_retries").collect();
        assert_eq!(fired.len(), 1);
        assert!(
            fired[0].summary.contains("retried cudaMalloc 3 times"),
            "{}",
            fired[0].summary
        );
        assert!(fired[0].remedy.contains("activation checkpointing"));
        assert!(
            !fired[0].remedy.contains("expandable_segments"),
            "not fragmented"
        );
        // No new retry: still firing within the window, resolved after it.
        let quiet = e.observe_process(&training(
            300_000,
            stats(300_000, 70 * GIB, 75 * GIB, 43, 0),
        ));
        assert!(transitions(&quiet, "alloc_retries").is_empty());
        let resolved = e.observe_process(&training(
            400_000,
            stats(400_000, 70 * GIB, 75 * GIB, 43, 0),
        ));
        assert_eq!(
            transitions(&resolved, "alloc_retries"),
            vec![Transition::Resolved]
        );

        // A process that stops reporting while retrying: the alert resolves
        // a window after the last retry, not when the process exits.
        let mut e = Engine::new(rules("[alloc_retries]\nwindow = \"5m\"\nmin_retries = 3\n"));
        e.observe_process(&training(0, stats(0, 70 * GIB, 75 * GIB, 0, 0)));
        let fired = e.observe_process(&training(30_000, stats(30_000, 70 * GIB, 75 * GIB, 5, 0)));
        assert_eq!(transitions(&fired, "alloc_retries").len(), 1);
        let mut later = Vec::new();
        for t in (60_000..=400_000).step_by(20_000) {
            later.extend(e.observe_process(&training(t, None)));
        }
        assert_eq!(
            transitions(&later, "alloc_retries"),
            vec![Transition::Resolved]
        );
    }
}
