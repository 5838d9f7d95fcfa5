//! Fragmentation: a process whose caching allocator holds memory that even
//! its peak never used. The job itself is fine, but that memory is lost to
//! every other process on the GPU, and the job's own large requests can
//! still fail on it. Only the allocator's report shows it; NVML sees one
//! opaque reservation.
//!
//! It compares the reservation with the *peak* allocation, not the current
//! one: between steps a healthy job's live tensors drop while the cache is
//! kept for the next step, and that is not waste. Both an absolute amount
//! and a share of the reservation must be exceeded (a few GiB of a huge
//! reservation, or a large share of a small one, is normal). It waits its
//! `for` so that one passing phase of a job (an evaluation, a checkpoint)
//! does not raise it, and once raised it holds down to three quarters of
//! both thresholds. A report that stops coming holds nothing up.

use crate::alert::{Alert, Message};
use crate::allocator::AllocatorObservation;
use crate::config::{RulesConfig, Severity};
use crate::describe::{device_name, process_name};
use crate::observation::ProcessObservation;
use crate::remedy::EXPANDABLE_SEGMENTS;
use crate::rule::{ProcessFacts, ProcessRule, Start};
use headroom_common::HumanBytes;

#[derive(Debug)]
pub(crate) struct Fragmentation;

impl ProcessRule for Fragmentation {
    fn start(_: &Start<'_, ProcessObservation<'_>>) -> Self {
        Self
    }

    fn observe(
        &mut self,
        config: &RulesConfig,
        o: &ProcessObservation<'_>,
        facts: &ProcessFacts,
        alert: &mut Alert<'_>,
    ) {
        let f = &config.fragmentation;
        if !f.enabled {
            return;
        }
        let report = facts.report;
        let held = alert.is_active();
        let scale = if held { 0.75 } else { 1.0 };
        let condition = report
            .filter(|a| {
                a.waste() as f64 >= f.min_waste.0 as f64 * scale
                    && a.waste_ratio() >= f.min_ratio * scale
            })
            .map(|_| Severity::Warning);
        let (waste, ratio) = report.map_or((0, 0.0), |a| (a.waste(), a.waste_ratio()));
        let labels = alert.labels();
        alert.step_with_remedy(
            o.timestamp_ms,
            condition,
            f.for_.ms(),
            || match report.filter(|_| condition.is_some()) {
                Some(a) => Message::new(
                    format!(
                        "{} on {}: the allocator holds {} but its tensors never needed more than {} (now {}); {} ({:.0} %) is cache even the peak leaves unused",
                        process_name(labels),
                        device_name(labels),
                        HumanBytes(a.reserved),
                        HumanBytes(a.peak_allocated.max(a.allocated)),
                        HumanBytes(a.allocated),
                        HumanBytes(a.waste()),
                        a.waste_ratio() * 100.0,
                    ),
                    serde_json::json!({
                        "allocated_bytes": a.allocated, "reserved_bytes": a.reserved,
                        "peak_allocated_bytes": a.peak_allocated,
                        "waste_bytes": a.waste(), "waste_ratio": a.waste_ratio(),
                        "fragmentation_bytes": a.fragmentation(),
                        "inactive_split_bytes": a.inactive_split,
                    }),
                ),
                None => Message::new(
                    format!("{} no longer holds fragmented cache", process_name(labels)),
                    serde_json::json!({}),
                ),
            },
            || remedy(waste, ratio),
        );
    }
}

/// Whether the process's newest report shows a fragmented reservation, by
/// this rule's ratio alone. The other allocator rules ask, to say in their
/// remedy when fragmentation is part of the trouble.
pub(crate) fn is_fragmented(report: Option<AllocatorObservation>, config: &RulesConfig) -> bool {
    report.is_some_and(|a| a.waste_ratio() >= config.fragmentation.min_ratio)
}

/// Memory the allocator holds beyond the job's peak need.
fn remedy(waste: u64, ratio: f64) -> String {
    format!(
        "The allocator holds {:.1} GiB ({:.0} % of what it reserved) more than the job's \
         tensors ever needed at once: freed blocks split too finely to reuse. Other processes \
         cannot use that memory, and large requests may still fail. {EXPANDABLE_SEGMENTS} \
         Calling torch.cuda.empty_cache() between phases (after evaluation) hands the cache back.",
        waste as f64 / f64::from(1u32 << 30),
        ratio * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alert::AlertChange;
    use crate::engine::Engine;
    use crate::engine_fixtures::{GIB, rules, stats, training, transitions};
    use crate::lifecycle::Transition;

    #[test]
    fn the_remedy_names_expandable_segments_and_the_waste() {
        assert!(remedy(3 << 30, 0.4).contains("expandable_segments:True"));
        assert!(
            remedy(3 << 30, 0.4).contains("3.0 GiB (40 % of what it reserved)"),
            "{}",
            remedy(3 << 30, 0.4)
        );
    }

    #[test]
    fn fragmentation_fires_after_its_duration_with_the_expandable_segments_remedy() {
        let mut e = Engine::new(rules("[fragmentation]\nfor = \"2m\"\n"));
        let mut all = Vec::new();
        // 40 GiB allocated of 50 reserved: 20 %, under the 30 % threshold.
        all.extend(e.observe_process(&training(0, stats(0, 40 * GIB, 50 * GIB, 0, 0))));
        assert!(transitions(&all, "fragmentation").is_empty());
        // 30 of 50: 20 GiB (40 %) held in no tensor, for 2 minutes.
        for t in [60_000, 120_000, 180_000] {
            all.extend(e.observe_process(&training(t, stats(t, 30 * GIB, 50 * GIB, 0, 0))));
        }
        let fired: Vec<&AlertChange> = all
            .iter()
            .filter(|c| {
                c.rule == "fragmentation" && matches!(c.transition, Transition::Firing { .. })
            })
            .collect();
        assert_eq!(fired.len(), 1, "{all:?}");
        assert!(
            fired[0]
                .summary
                .contains("20 GiB (40 %) is cache even the peak leaves unused"),
            "{}",
            fired[0].summary
        );
        assert!(
            fired[0]
                .remedy
                .contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        );
        assert_eq!(fired[0].details["fragmentation_bytes"], 20 * GIB);
        // 35 % still holds it (hysteresis); 10 % resolves it.
        let held = e.observe_process(&training(240_000, stats(240_000, 32 * GIB, 50 * GIB, 0, 0)));
        assert!(transitions(&held, "fragmentation").is_empty());
        let done = e.observe_process(&training(300_000, stats(300_000, 45 * GIB, 50 * GIB, 0, 0)));
        let resolved: Vec<&AlertChange> =
            done.iter().filter(|c| c.rule == "fragmentation").collect();
        assert_eq!(resolved.len(), 1);
        assert_eq!(resolved[0].transition, Transition::Resolved);
        assert!(resolved[0].remedy.is_empty(), "no advice on resolution");

        // Between steps a healthy job's live tensors drop while the cache
        // stays for the next step: not fragmentation when the peak used it.
        let mut healthy = Engine::new(rules("[fragmentation]\nfor = \"0s\"\n"));
        let mut between_steps = stats(0, 20 * GIB, 50 * GIB, 0, 0);
        if let Some(s) = between_steps.as_mut() {
            s.peak_allocated = 48 * GIB;
        }
        let quiet = healthy.observe_process(&training(0, between_steps));
        assert!(transitions(&quiet, "fragmentation").is_empty(), "{quiet:?}");
    }
}
