//! Allocator OOM: a process whose caching allocator raised CUDA
//! out-of-memory errors. A job that crashes on one is seen by its owner; a
//! job that catches them (and skips a batch, or retries smaller) hides them,
//! and only the allocator's report still counts them.
//!
//! It is critical and fires at once: an OOM is not a forecast. The counter
//! is cumulative since the process started, so only errors raised while we
//! watched count. The alert holds for `resolve_after` past the newest
//! error, so that a job hitting them again and again raises one alert, not
//! one per error; it resolves sooner only when the process exits.

use headroom_common::Breakdown;

use crate::alert::{Alert, Message};
use crate::allocator::AllocatorObservation;
use crate::config::{RulesConfig, Severity};
use crate::describe::{device_name, minutes, process_name};
use crate::observation::ProcessObservation;
use crate::remedy::{self, CUT_THE_PEAK, EXPANDABLE_SEGMENTS};
use crate::rule::{ProcessFacts, ProcessRule, Start};
use crate::rules::fragmentation;
use headroom_common::HumanBytes;

#[derive(Debug)]
pub(crate) struct AllocatorOom {
    watch: OomWatch,
}

impl ProcessRule for AllocatorOom {
    fn start(start: &Start<'_, ProcessObservation<'_>>) -> Self {
        Self {
            watch: OomWatch::restored(start.restored_at_ms),
        }
    }

    fn observe(
        &mut self,
        config: &RulesConfig,
        o: &ProcessObservation<'_>,
        facts: &ProcessFacts,
        alert: &mut Alert<'_>,
    ) {
        if let Some(a) = o.allocator {
            self.watch.observe(a);
        }
        let m = &config.allocator_oom;
        if !m.enabled {
            return;
        }
        let now = o.timestamp_ms;
        let last_oom = self.watch.oom_within(m.resolve_after.ms(), now);
        let seen = self.watch.ooms_seen();
        let last = facts.last_report;
        let labels = alert.labels();
        alert.step_with_remedy(
            now,
            last_oom.map(|_| Severity::Critical),
            0,
            || match (last_oom, last) {
                (Some(at), Some(a)) => Message::new(
                    format!(
                        "{} on {} ran out of GPU memory: {seen} CUDA out-of-memory error(s) from its allocator, the latest {} ago; {} allocated, {} reserved",
                        process_name(labels),
                        device_name(labels),
                        minutes(now - at),
                        HumanBytes(a.allocated),
                        HumanBytes(a.reserved),
                    ),
                    serde_json::json!({
                        "ooms_seen": seen, "ooms": a.ooms, "last_oom_ms": at,
                        "allocated_bytes": a.allocated, "reserved_bytes": a.reserved,
                    }),
                ),
                _ => Message::new(
                    format!(
                        "{} had no out-of-memory error for {}",
                        process_name(labels),
                        minutes(m.resolve_after.ms())
                    ),
                    serde_json::json!({ "ooms_seen": seen }),
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

/// The allocator raised out-of-memory errors.
fn remedy(fragmented: bool, breakdown: Option<&Breakdown>) -> String {
    let mut text = format!(
        "The job ran out of GPU memory. {}",
        remedy::fitting_the_largest_share(breakdown, CUT_THE_PEAK)
    );
    if fragmented && !remedy::leads_with_cache(breakdown) {
        text.push_str(" The allocator held much more than it had allocated: ");
        text.push_str(EXPANDABLE_SEGMENTS);
    }
    text
}

/// The OOM counter of one process as it moved while we watched.
#[derive(Debug, Default)]
struct OomWatch {
    /// The newest report taken, to ignore the same report arriving again.
    last_report_ms: Option<i64>,
    last_ooms: Option<u64>,
    last_oom_ms: Option<i64>,
    /// OOMs seen while watching (not those before the first report).
    ooms_seen: u64,
}

impl OomWatch {
    /// An alert restored as firing after a collector restart: keep it held
    /// as if its signal was last seen when it started, instead of resolving
    /// it on the first quiet report.
    fn restored(firing_since: Option<i64>) -> Self {
        Self {
            last_oom_ms: firing_since,
            ..Self::default()
        }
    }

    /// Takes a report; reports no newer than the newest one are ignored (the
    /// same report can arrive with several intervals).
    fn observe(&mut self, o: AllocatorObservation) {
        if self.last_report_ms.is_some_and(|t| o.timestamp_ms <= t) {
            return;
        }
        self.last_report_ms = Some(o.timestamp_ms);
        if let Some(before) = self.last_ooms
            && o.ooms > before
        {
            self.ooms_seen += o.ooms - before;
            self.last_oom_ms = Some(o.timestamp_ms);
        }
        self.last_ooms = Some(o.ooms);
    }

    /// The newest OOM, when it is less than `hold_ms` old.
    fn oom_within(&self, hold_ms: i64, now_ms: i64) -> Option<i64> {
        self.last_oom_ms.filter(|t| now_ms - *t < hold_ms)
    }

    fn ooms_seen(&self) -> u64 {
        self.ooms_seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alert::AlertChange;
    use crate::engine::{Engine, PROCESS_GONE_MS};
    use crate::engine_fixtures::report;
    use crate::engine_fixtures::{GIB, rules, stats, training, transitions};
    use crate::lifecycle::Transition;

    #[test]
    fn an_oom_counts_from_when_it_happens_and_replays_are_ignored() {
        let mut w = OomWatch::default();
        w.observe(report(0, 0, 2));
        assert_eq!(w.oom_within(600_000, 0), None, "OOMs before watching");
        w.observe(report(1_000, 0, 3));
        w.observe(report(1_000, 0, 3));
        w.observe(report(500, 0, 9));
        assert_eq!(w.ooms_seen(), 1);
        assert_eq!(w.oom_within(600_000, 2_000), Some(1_000));
        assert_eq!(w.oom_within(600_000, 601_000), None);
    }

    #[test]
    fn the_remedy_cuts_the_peak() {
        assert!(remedy(false, None).contains("gradient accumulation"));
    }

    #[test]
    fn an_oom_of_a_job_that_counts_its_tensors_names_its_largest_share() {
        use crate::engine_fixtures::adam_composition;
        let counted = |ts, ooms| {
            stats(ts, 70 * GIB, 78 * GIB, 0, ooms).map(|r| AllocatorObservation {
                composition: Some(adam_composition()),
                ..r
            })
        };
        let mut e = Engine::new(rules(""));
        e.observe_process(&training(0, counted(0, 0)));
        let oom = e.observe_process(&training(1_000, counted(1_000, 1)));
        let fired: Vec<&AlertChange> = oom.iter().filter(|c| c.rule == "allocator_oom").collect();
        assert_eq!(fired.len(), 1);
        // 70 GiB at the peak: 24 counted, so activations (46 GiB) lead.
        assert!(
            fired[0]
                .remedy
                .contains("Activations and temporaries are 46 GiB"),
            "{}",
            fired[0].remedy
        );
    }

    #[test]
    fn an_allocator_oom_fires_at_once_as_critical() {
        let mut e = Engine::new(rules(""));
        e.observe_process(&training(0, stats(0, 70 * GIB, 78 * GIB, 0, 0)));
        let oom = e.observe_process(&training(1_000, stats(1_000, 70 * GIB, 78 * GIB, 1, 1)));
        let fired: Vec<&AlertChange> = oom.iter().filter(|c| c.rule == "allocator_oom").collect();
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].severity, Severity::Critical);
        assert!(
            fired[0].summary.contains("1 CUDA out-of-memory error"),
            "{}",
            fired[0].summary
        );
        assert!(fired[0].remedy.contains("gradient accumulation"));
        // The process exits: its OOM alert resolves with it.
        let gone = e.tick(1_000 + PROCESS_GONE_MS + 1);
        assert_eq!(
            transitions(&gone, "allocator_oom"),
            vec![Transition::Resolved]
        );
        // A process that does not report raises nothing.
        let mut quiet = Engine::new(rules(""));
        let none = quiet.observe_process(&training(0, None));
        assert!(none.iter().all(|c| !c.rule.starts_with("alloc")));
    }
}
