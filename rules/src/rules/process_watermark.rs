//! Process watermark: one process holding more than a configured number of
//! bytes. Off unless `watermark.process_bytes` is set, since a fair share
//! depends on the site: on shared GPUs it is how an operator learns who
//! crowds the others out before the device watermark fires for everyone.
//!
//! It shares the device watermark's settings so one `for` and one
//! hysteresis govern both; the clearing level is the limit scaled by the
//! device's `clear_below / warning`, the same proportion below the line.

use crate::alert::{Alert, Message};
use crate::config::{RulesConfig, Severity};
use crate::describe::{device_name, process_name};
use crate::observation::ProcessObservation;
use crate::rule::{ProcessFacts, ProcessRule, Start};
use headroom_common::HumanBytes;

#[derive(Debug)]
pub(crate) struct ProcessWatermark;

impl ProcessRule for ProcessWatermark {
    fn start(_: &Start<'_, ProcessObservation<'_>>) -> Self {
        Self
    }

    fn observe(
        &mut self,
        config: &RulesConfig,
        o: &ProcessObservation<'_>,
        _: &ProcessFacts,
        alert: &mut Alert<'_>,
    ) {
        let w = &config.watermark;
        if !w.enabled {
            return;
        }
        let Some(limit) = w.process_bytes else {
            return;
        };
        let held = alert.is_active();
        let clear = (limit.0 as f64 * w.clear_below / w.warning) as u64;
        let condition =
            (o.used_max >= limit.0 || (held && o.used_max >= clear)).then_some(Severity::Warning);
        let labels = alert.labels();
        alert.step(o.timestamp_ms, condition, w.for_.ms(), || {
            Message::new(
                format!(
                    "{} on {} holds {} (limit {})",
                    process_name(labels),
                    device_name(labels),
                    HumanBytes(o.used_max),
                    HumanBytes(limit.0)
                ),
                serde_json::json!({ "used_bytes": o.used_last, "peak_bytes": o.used_max, "limit_bytes": limit.0 }),
            )
        });
    }
}
