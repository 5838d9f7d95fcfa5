//! Unattributed memory: memory in use on a GPU that no process the agent
//! can see holds. It is how a zombie CUDA context (a process gone, its
//! memory not) or a process in another PID namespace shows up, and neither
//! appears in any per-process view, so only the gap between the device's
//! total and its processes' sum reveals them.
//!
//! It judges only intervals that come with a process report: without one
//! the gap is unknown, not the whole of used memory. The threshold keeps
//! small gaps out, and the `for` keeps out the brief ones a process starting
//! or exiting between the device read and the process list makes. Once
//! raised, it holds down to half the threshold so that it does not flap as
//! the processes' memory moves.

use crate::alert::{Alert, Message};
use crate::config::{RulesConfig, Severity};
use crate::describe::device_name;
use crate::observation::DeviceObservation;
use crate::rule::{DeviceRule, Start};
use headroom_common::HumanBytes;

#[derive(Debug)]
pub(crate) struct Unattributed;

impl DeviceRule for Unattributed {
    fn start(_: &Start<'_, DeviceObservation<'_>>) -> Self {
        Self
    }

    fn observe(&mut self, config: &RulesConfig, o: &DeviceObservation<'_>, alert: &mut Alert<'_>) {
        let u = &config.unattributed;
        if !u.enabled {
            return;
        }
        let Some(attributed) = o.attributed else {
            return;
        };
        let unexplained = o.used_last.saturating_sub(attributed);
        let held = alert.is_active();
        let threshold = u.threshold.0;
        let condition = (unexplained >= threshold || (held && unexplained >= threshold / 2))
            .then_some(Severity::Warning);
        let labels = alert.labels();
        alert.step(o.timestamp_ms, condition, u.for_.ms(), || {
            Message::new(
                format!(
                    "{}: {} in use by no visible process (zombie context, or a process in another PID namespace)",
                    device_name(labels),
                    HumanBytes(unexplained)
                ),
                serde_json::json!({ "unattributed_bytes": unexplained, "used_bytes": o.used_last }),
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
    fn unattributed_memory_needs_its_for_and_names_the_amount() {
        let mut e = Engine::new(rules(
            "[unattributed]\nthreshold = \"2GiB\"\nfor = \"10s\"\n",
        ));
        let mut all = Vec::new();
        for s in 0..15 {
            all.extend(e.observe_device(&device(s * 1000, 20 * GIB, Some(17 * GIB))));
        }
        assert_eq!(
            transitions(&all, "unattributed"),
            vec![
                Transition::Pending {
                    severity: Severity::Warning
                },
                Transition::Firing {
                    severity: Severity::Warning,
                    escalated: false
                },
            ]
        );
        assert!(
            all.iter()
                .any(|c| c.summary.contains("3 GiB in use by no visible process"))
        );
        // Without process reports the rule cannot judge, and stays quiet.
        let mut e = Engine::new(rules(""));
        let quiet: Vec<_> = (0..300)
            .flat_map(|s| e.observe_device(&device(s * 1000, 20 * GIB, None)))
            .collect();
        assert!(transitions(&quiet, "unattributed").is_empty());
    }
}
