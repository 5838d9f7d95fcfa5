//! Watermark: a GPU or MIG instance whose memory (used plus reserved, at its
//! peak within the interval) passes a share of its total. The simplest
//! early warning there is, and the one every operator expects.
//!
//! It reads the interval's peak, not its last reading, because an OOM
//! happens at the peak; a job that touches 97 % for a moment each step is
//! in danger even if it is sampled at 80 %. Two levels (warning, critical)
//! escalate one alert instead of raising two. Once raised, the alert holds
//! down to `clear_below`, so memory hovering at the line does not flap.

use crate::alert::{Alert, Message};
use crate::config::{RulesConfig, Severity};
use crate::describe::{device_name, percent};
use crate::observation::DeviceObservation;
use crate::rule::{DeviceRule, Start};
use headroom_common::HumanBytes;

#[derive(Debug)]
pub(crate) struct Watermark;

impl DeviceRule for Watermark {
    fn start(_: &Start<'_, DeviceObservation<'_>>) -> Self {
        Self
    }

    fn observe(&mut self, config: &RulesConfig, o: &DeviceObservation<'_>, alert: &mut Alert<'_>) {
        let w = &config.watermark;
        if !w.enabled {
            return;
        }
        let total = o.total;
        let used = o.used_last.saturating_add(o.reserved);
        let peak = o.used_max.saturating_add(o.reserved);
        let frac = if total == 0 {
            0.0
        } else {
            peak as f64 / total as f64
        };
        let held = alert.is_active();
        let condition = if frac >= w.critical {
            Some(Severity::Critical)
        } else if frac >= w.warning || (held && frac >= w.clear_below) {
            Some(Severity::Warning)
        } else {
            None
        };
        let labels = alert.labels();
        alert.step(o.timestamp_ms, condition, w.for_.ms(), || {
            Message::new(
                format!(
                    "{} at {:.1} % of {} (peak {:.1} %, {} free)",
                    device_name(labels),
                    percent(used, total),
                    HumanBytes(total),
                    percent(peak, total),
                    HumanBytes(total.saturating_sub(used))
                ),
                serde_json::json!({
                    "used_bytes": o.used_last, "peak_bytes": o.used_max, "reserved_bytes": o.reserved,
                    "total_bytes": total, "used_fraction": frac,
                }),
            )
        });
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Severity;
    use crate::engine::Engine;
    use crate::engine_fixtures::{GIB, device, rules, transitions};
    use crate::lifecycle::Transition;

    #[test]
    fn watermark_uses_hysteresis_and_escalates() {
        let mut e = Engine::new(rules(""));
        let mut all = Vec::new();
        for (i, used) in [80, 91, 88, 86, 96, 89, 84, 91].iter().enumerate() {
            all.extend(e.observe_device(&device(i as i64 * 1000, used * GIB, None)));
        }
        assert_eq!(
            transitions(&all, "watermark"),
            vec![
                Transition::Firing {
                    severity: Severity::Warning,
                    escalated: false
                },
                Transition::Firing {
                    severity: Severity::Critical,
                    escalated: true
                },
                Transition::Resolved,
                Transition::Firing {
                    severity: Severity::Warning,
                    escalated: false
                },
            ],
            "88 % and 86 % stay firing (above clear_below 85 %); 84 % resolves"
        );
        let fired = all.iter().find(|c| c.rule == "watermark").unwrap();
        assert_eq!(fired.labels["node"], "n1");
        assert_eq!(fired.labels["gpu"], "1");
        assert!(
            fired.summary.contains("GPU 1 on n1 at 91.0 %"),
            "{}",
            fired.summary
        );
    }
}
