//! XID: an error the NVIDIA driver logged for a GPU (ECC errors, a GPU
//! fallen off the bus, MMU faults, GSP timeouts). They appear only in the
//! kernel log of the node, where nobody watching memory would look, yet
//! several mean the GPU must be drained.
//!
//! Each code on each GPU is its own alert, because codes differ in meaning
//! and in severity (from the XID catalogue in `xid.rs` at the crate root),
//! and a GPU can show several at once. It fires on the first occurrence; a
//! recurrence is not news. XIDs have no "cleared" event, so the alert
//! resolves once its code has not recurred for `events.xid_resolve_after`.

use std::collections::BTreeMap;

use crate::alert::{Alert, Message};
use crate::config::RulesConfig;
use crate::describe::{event_detail, event_place, minutes};
use crate::observation::EventObservation;
use crate::rule::{EventRule, Outcome};
use crate::xid as catalogue;

#[derive(Debug)]
pub(crate) struct Xid {
    code: i64,
}

impl EventRule for Xid {
    fn accepts(config: &RulesConfig, e: &EventObservation<'_>) -> Option<i64> {
        (config.events.enabled && e.kind == "xid").then_some(e.code)
    }

    fn start(code: i64) -> Self {
        Self { code }
    }

    fn label(&self, labels: &mut BTreeMap<String, String>) {
        labels.insert("xid".to_owned(), self.code.to_string());
    }

    fn observe(&mut self, _: &RulesConfig, e: &EventObservation<'_>, alert: &mut Alert<'_>) {
        let code = self.code;
        let labels = alert.labels();
        alert.step(e.timestamp_ms, Some(catalogue::severity(code)), 0, || {
            Message::new(
                format!(
                    "XID {code} on {}: {}{}",
                    event_place(labels, e.node),
                    catalogue::meaning(code),
                    event_detail(e.detail)
                ),
                serde_json::json!({ "code": code, "detail": e.detail }),
            )
        });
    }

    fn tick(
        &mut self,
        config: &RulesConfig,
        now_ms: i64,
        last_event_ms: i64,
        alert: &mut Alert<'_>,
    ) -> Outcome {
        // Checked even while events are off, so that turning them off does
        // not leave XID alerts firing for ever.
        let quiet_after = config.events.xid_resolve_after.ms();
        if now_ms - last_event_ms <= quiet_after {
            return Outcome::Keep;
        }
        alert.step(now_ms, None, 0, || {
            Message::new(
                format!(
                    "XID {} has not recurred for {}",
                    self.code,
                    minutes(quiet_after)
                ),
                serde_json::json!({}),
            )
        });
        Outcome::Close
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Severity;
    use crate::engine::Engine;
    use crate::engine_fixtures::{event, rules, transitions};
    use crate::lifecycle::Transition;

    #[test]
    fn xid_fires_with_its_meaning_and_resolves_when_it_stops_recurring() {
        let mut e = Engine::new(rules("[events]\nxid_resolve_after = \"10m\"\n"));
        let fired = e.observe_event(&event("xid", 79, 1000));
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].severity, Severity::Critical);
        assert_eq!(fired[0].labels["xid"], "79");
        assert!(
            fired[0]
                .summary
                .contains("XID 79 on GPU 1 on n1: GPU has fallen off the bus"),
            "{}",
            fired[0].summary
        );
        assert!(
            e.observe_event(&event("xid", 79, 60_000)).is_empty(),
            "a recurrence is not news"
        );
        assert_eq!(
            e.observe_event(&event("xid", 31, 61_000)).len(),
            1,
            "another code is its own alert"
        );
        assert!(
            transitions(&e.tick(600_000), "xid").is_empty(),
            "79 recurred at 60 s"
        );
        let resolved = e.tick(662_000);
        assert_eq!(
            transitions(&resolved, "xid"),
            vec![Transition::Resolved, Transition::Resolved]
        );
    }
}
