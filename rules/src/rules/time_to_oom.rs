//! Time to OOM: a GPU or MIG instance whose memory climbs steadily enough
//! to run out within the horizon. The watermark says memory is high; this
//! says it will be full, while there is still time to act on a job that
//! grows slowly from a comfortable level.
//!
//! The forecast itself (climbs of the GPU's peaks and of each process's,
//! their growth ahead) is `oom.rs`; this rule feeds it every interval of the
//! device and of each process on it, judges against
//! the memory that can still be allocated (total less what the driver
//! reserves), and turns critical when the predicted OOM is within the
//! nearest third of the horizon. A forecast has to hold for `for` (30 s by
//! default) before it warns: the end of a fast climb that has just stopped
//! still looks like a ramp for a few evaluations.

use crate::alert::{Alert, Message};
use crate::config::{RulesConfig, Severity};
use crate::describe::{device_name, minutes};
use crate::observation::{DeviceObservation, ProcessObservation};
use crate::oom::OomPredictor;
use crate::remedy::{self, CUT_THE_PEAK};
use crate::rule::{DeviceRule, Start};
use headroom_common::{Breakdown, HumanBytes};

#[derive(Debug)]
pub(crate) struct TimeToOom {
    predictor: OomPredictor,
}

impl DeviceRule for TimeToOom {
    fn start(start: &Start<'_, DeviceObservation<'_>>) -> Self {
        // Sized for the configured window; a reload to a longer window takes
        // effect for series seen after it.
        Self {
            predictor: OomPredictor::with_config(&start.config.time_to_oom.oom_config()),
        }
    }

    fn observe_process(&mut self, o: &ProcessObservation<'_>) {
        self.predictor
            .observe_process(o.pid, o.start_time_ms, o.timestamp_ms, o.used_max);
    }

    fn observe(&mut self, config: &RulesConfig, o: &DeviceObservation<'_>, alert: &mut Alert<'_>) {
        // Fed even while the rule is off, so that turning it on by a reload
        // judges a full window at once.
        self.predictor.observe(o.timestamp_ms, o.used_max);
        let t = &config.time_to_oom;
        if !t.enabled {
            return;
        }
        let total = o.total;
        let used = o.used_last.saturating_add(o.reserved);
        let limit = total.saturating_sub(o.reserved);
        let prediction =
            self.predictor
                .evaluate(&t.oom_config(), limit, o.used_max, o.timestamp_ms);
        let condition = prediction.as_ref().map(|p| {
            if p.predicted_oom_at_ms - o.timestamp_ms <= t.horizon.ms() / 3 {
                Severity::Critical
            } else {
                Severity::Warning
            }
        });
        let labels = alert.labels();
        alert.step_with_remedy(
            o.timestamp_ms,
            condition,
            t.for_.ms(),
            || match &prediction {
                Some(p) => Message::new(
                    format!(
                        "{} will run out of memory in about {} (between {} and {}): it rose {} over the last {}{} and grows {}/min now, trend confidence {:.0} %; {} used of {}",
                        device_name(labels),
                        minutes(p.predicted_oom_at_ms - o.timestamp_ms),
                        minutes(p.earliest_ms - o.timestamp_ms),
                        if p.latest_ms == i64::MAX {
                            "never".to_owned()
                        } else {
                            minutes(p.latest_ms - o.timestamp_ms)
                        },
                        HumanBytes(p.risen_bytes.max(0.0) as u64),
                        minutes(p.window_ms),
                        p.pid.map(|pid| format!(", led by pid {pid}")).unwrap_or_default(),
                        HumanBytes((p.growth_bytes_per_s * 60.0).max(0.0) as u64),
                        // Floored, so a trend short of certain never reads 100 %.
                        (p.confidence * 100.0).floor(),
                        HumanBytes(used),
                        HumanBytes(total),
                    ),
                    serde_json::json!({
                        "predicted_oom_at_ms": p.predicted_oom_at_ms, "earliest_ms": p.earliest_ms,
                        "latest_ms": if p.latest_ms == i64::MAX { serde_json::Value::Null } else { p.latest_ms.into() },
                        "growth_bytes_per_s": p.growth_bytes_per_s, "confidence": p.confidence,
                        "used_bytes": o.used_last, "total_bytes": total,
                        "window_ms": p.window_ms, "risen_bytes": p.risen_bytes,
                        "leading_pid": p.pid,
                    }),
                ),
                None => Message::new(
                    format!("{} no longer trends towards OOM", device_name(labels)),
                    serde_json::json!({ "used_bytes": o.used_last, "total_bytes": total }),
                ),
            },
            || remedy(o.largest_process.as_ref()),
        );
    }
}

/// Which job grows is for the owner to see. Where the biggest process on
/// the device says what its memory holds, the advice fits its largest
/// share; otherwise it is the same for any training job.
fn remedy(largest_process: Option<&Breakdown>) -> String {
    match largest_process.and_then(remedy::for_largest_share) {
        Some(text) => format!("The largest process on it that reports its tensors: {text}"),
        None => format!("If a training job is the one growing: {CUT_THE_PEAK}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_remedy_cuts_the_peak_or_fits_the_largest_share() {
        assert!(remedy(None).contains("bf16 autocast"));
        let optimizer_heavy = crate::engine_fixtures::breakdown_led_by_optimizer_state();
        let text = remedy(Some(&optimizer_heavy));
        assert!(text.contains("Optimizer state is"), "{text}");
        assert!(text.contains("sharded optimizer"), "{text}");
    }
}
