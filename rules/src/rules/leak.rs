//! Leak: a process whose memory floor keeps rising, step after step, for
//! the whole evidence window (the definition is `leak.rs` at the crate root). Growth like that ends in an OOM hours later,
//! far beyond what time-to-OOM can see, and the owner can usually fix it
//! once told which job and how fast.
//!
//! The statistics (the floor in windows from 30 min to 8 h, a monotone
//! trend in both halves, still rising, new memory) are there; this rule
//! feeds it every interval of the process and raises a warning, never more:
//! a leak is slow by nature, and the OOM rules escalate when it bites. The
//! remedy depends on what the process's allocator says: when its reservation
//! is fragmented, it is not live tensors that grow.

use crate::alert::{Alert, Message};
use crate::config::{RulesConfig, Severity};
use crate::describe::{device_name, minutes, process_name};
use crate::leak::LeakDetector;
use crate::observation::ProcessObservation;
use crate::remedy::{self, EXPANDABLE_SEGMENTS};
use crate::rule::{ProcessFacts, ProcessRule, Start};
use crate::rules::fragmentation;
use headroom_common::HumanBytes;

#[derive(Debug)]
pub(crate) struct Leak {
    detector: LeakDetector,
}

impl ProcessRule for Leak {
    fn start(start: &Start<'_, ProcessObservation<'_>>) -> Self {
        Self {
            detector: LeakDetector::with_config(
                start.observation.start_time_ms,
                &start.config.leak.leak_config(),
            ),
        }
    }

    fn observe(
        &mut self,
        config: &RulesConfig,
        o: &ProcessObservation<'_>,
        facts: &ProcessFacts,
        alert: &mut Alert<'_>,
    ) {
        // Fed even while the rule is off, so that turning it on by a reload
        // judges a full window at once.
        self.detector.observe(o.timestamp_ms, o.used_last);
        let l = &config.leak;
        if !l.enabled {
            return;
        }
        let finding = self.detector.evaluate(&l.leak_config());
        let labels = alert.labels();
        alert.step_with_remedy(
            o.timestamp_ms,
            finding.as_ref().map(|_| Severity::Warning),
            0,
            || match &finding {
                Some(f) => Message::new(
                    format!(
                        "{} on {} leaks: the least it held rose from {} to {} over the last {} \
                         (+{}/min), and still rose +{}/min over the last {}; now {}",
                        process_name(labels),
                        device_name(labels),
                        HumanBytes(f.floor_from_bytes.max(0.0) as u64),
                        HumanBytes(f.floor_to_bytes.max(0.0) as u64),
                        minutes(f.window_ms),
                        HumanBytes(f.rate_bytes_per_min.max(0.0) as u64),
                        HumanBytes(f.recent_rate_bytes_per_min.max(0.0) as u64),
                        minutes(f.window_ms / 3),
                        HumanBytes(o.used_last),
                    ),
                    serde_json::json!({
                        "growth_bytes_per_min": f.rate_bytes_per_min, "since_ms": f.since_ms,
                        "window_ms": f.window_ms, "floor_from_bytes": f.floor_from_bytes,
                        "floor_to_bytes": f.floor_to_bytes,
                        "recent_growth_bytes_per_min": f.recent_rate_bytes_per_min,
                        "p_value": f.p_value, "used_bytes": o.used_last, "peak_bytes": o.used_max,
                    }),
                ),
                None => Message::new(
                    format!("{} stopped growing", process_name(labels)),
                    serde_json::json!({ "used_bytes": o.used_last }),
                ),
            },
            || {
                let mut text = remedy(fragmentation::is_fragmented(facts.report, config));
                if let Some(share) = facts
                    .breakdown(o)
                    .as_ref()
                    .and_then(remedy::for_largest_share)
                {
                    text.push_str(" Where its memory is now: ");
                    text.push_str(&share);
                }
                text
            },
        );
    }
}

/// Memory that grows step after step. When the allocator says live tensors
/// are flat and only its reservation grows, it is fragmentation instead.
fn remedy(fragmentation_grows: bool) -> String {
    if fragmentation_grows {
        format!(
            "Live tensors are not what grows: the allocator's reservation is, through \
             fragmentation. {EXPANDABLE_SEGMENTS}"
        )
    } else {
        "Steady growth across steps usually means tensors kept alive across iterations: a loss \
         summed without .item() or .detach(), outputs or hidden states appended to a list, a \
         cache or hook holding references. Compare torch.cuda.memory_snapshot() between two \
         steps to find what stays."
            .to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_remedy_tells_a_leak_from_fragmentation() {
        assert!(remedy(false).contains("tensors kept alive across iterations"));
        assert!(remedy(true).contains("expandable_segments"));
    }
}
