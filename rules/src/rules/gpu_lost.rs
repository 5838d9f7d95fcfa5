//! Lost GPU: NVML answers `GPU_IS_LOST` for a device. The GPU has dropped
//! off the bus or hung hard; every job on it is dead or about to be, and its
//! memory readings stop, so no memory rule can say so.
//!
//! It is critical, one alert per GPU whatever the agent's code, and fires
//! at once. There is no "found again" event: the alert resolves when the
//! device's memory is read again, and only by a sample taken after the
//! loss, since one already in flight says nothing about recovery.

use crate::alert::{Alert, Message};
use crate::config::{RulesConfig, Severity};
use crate::describe::{event_detail, event_place};
use crate::observation::EventObservation;
use crate::rule::{EventRule, Outcome, resolve_when_read_after};

#[derive(Debug)]
pub(crate) struct GpuLost;

impl EventRule for GpuLost {
    fn accepts(config: &RulesConfig, e: &EventObservation<'_>) -> Option<i64> {
        (config.events.enabled && e.kind == "gpu_lost").then_some(0)
    }

    fn start(_: i64) -> Self {
        Self
    }

    fn observe(&mut self, _: &RulesConfig, e: &EventObservation<'_>, alert: &mut Alert<'_>) {
        let labels = alert.labels();
        alert.step(e.timestamp_ms, Some(Severity::Critical), 0, || {
            Message::new(
                format!(
                    "{} is lost: NVML answers GPU_IS_LOST{}",
                    event_place(labels, e.node),
                    event_detail(e.detail)
                ),
                serde_json::json!({ "code": 0, "detail": e.detail }),
            )
        });
    }

    fn device_reports(&mut self, ts_ms: i64, last_event_ms: i64, alert: &mut Alert<'_>) -> Outcome {
        resolve_when_read_after(ts_ms, last_event_ms, alert)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Severity;
    use crate::engine::Engine;
    use crate::engine_fixtures::{GIB, device, event, rules, transitions};
    use crate::lifecycle::Transition;

    #[test]
    fn lost_gpu_resolves_when_its_memory_is_read_again() {
        let mut e = Engine::new(rules(""));
        let lost = e.observe_event(&event("gpu_lost", 0, 5000));
        assert_eq!(
            transitions(&lost, "gpu_lost"),
            vec![Transition::Firing {
                severity: Severity::Critical,
                escalated: false
            }]
        );
        assert!(
            transitions(&e.observe_device(&device(4000, GIB, None)), "gpu_lost").is_empty(),
            "a sample from before the loss"
        );
        let back = e.observe_device(&device(9000, GIB, None));
        assert_eq!(transitions(&back, "gpu_lost"), vec![Transition::Resolved]);
        assert!(
            e.observe_event(&event("process_started", 0, 9500))
                .is_empty()
        );
    }
}
