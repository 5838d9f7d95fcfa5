//! Hung NVML: the agent's calls into NVML for a GPU stopped returning. The
//! agent keeps running but its readings of that GPU are stale, so every
//! memory rule on it is judging old data; people must know not to trust
//! the dashboard for that GPU.
//!
//! A warning rather than critical: the GPU itself may be fine and the jobs
//! on it running. One alert per GPU, fired at once, resolved when the
//! device's memory is read again by a sample taken after the hang was
//! reported.

use crate::alert::{Alert, Message};
use crate::config::{RulesConfig, Severity};
use crate::describe::{event_detail, event_place};
use crate::observation::EventObservation;
use crate::rule::{EventRule, Outcome, resolve_when_read_after};

#[derive(Debug)]
pub(crate) struct NvmlHung;

impl EventRule for NvmlHung {
    fn accepts(config: &RulesConfig, e: &EventObservation<'_>) -> Option<i64> {
        (config.events.enabled && e.kind == "nvml_hung").then_some(0)
    }

    fn start(_: i64) -> Self {
        Self
    }

    fn observe(&mut self, _: &RulesConfig, e: &EventObservation<'_>, alert: &mut Alert<'_>) {
        let labels = alert.labels();
        alert.step(e.timestamp_ms, Some(Severity::Warning), 0, || {
            Message::new(
                format!(
                    "NVML calls hang on {}; its readings are stale{}",
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
