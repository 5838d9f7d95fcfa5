//! Silent agent: a node that has sent nothing for a number of its own
//! sample intervals. Every other rule judges data that arrives; a node
//! whose agent died, or whose network is cut, raises none of them, and its
//! GPUs could be full without anyone knowing.
//!
//! The limit counts intervals rather than seconds because nodes register
//! different intervals and a fixed time would be too eager for some and too
//! lax for others. It is judged as time passes, not per sample, since what
//! it looks for is the absence of one. It resolves on the node's first
//! device sample, whether or not the rule is still on, so that an alert
//! never outlives the silence it reported.

use crate::alert::{Alert, Message};
use crate::config::{RulesConfig, Severity};
use crate::describe::minutes;
use crate::rule::{NodeFacts, NodeRule};

#[derive(Debug)]
pub(crate) struct AgentSilent;

impl NodeRule for AgentSilent {
    fn start() -> Self {
        Self
    }

    fn tick(
        &mut self,
        config: &RulesConfig,
        node: &NodeFacts<'_>,
        now_ms: i64,
        alert: &mut Alert<'_>,
    ) {
        let s = &config.agent_silent;
        if !s.enabled {
            return;
        }
        let quiet_ms = now_ms - node.last_seen_ms;
        let limit = node.interval_ms * i64::from(s.intervals);
        let condition = (quiet_ms > limit).then_some(Severity::Critical);
        alert.step(now_ms, condition, 0, || {
            Message::new(
                format!("{} has sent nothing for {}", node.node, minutes(quiet_ms)),
                serde_json::json!({ "last_seen_ms": node.last_seen_ms }),
            )
        });
    }

    fn heard(&mut self, _: &RulesConfig, node: &NodeFacts<'_>, ts_ms: i64, alert: &mut Alert<'_>) {
        alert.step(ts_ms, None, 0, || {
            Message::new(
                format!("{} reports again", node.node),
                serde_json::json!({}),
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
    fn silent_agent_fires_then_resolves_when_it_reports() {
        let mut e = Engine::new(rules("[agent_silent]\nintervals = 5\n"));
        e.node_registered("n1", 1000, 0);
        e.observe_device(&device(1000, GIB, None));
        assert!(e.tick(5000).is_empty());
        let fired = e.tick(7000);
        assert_eq!(
            transitions(&fired, "agent_silent"),
            vec![Transition::Firing {
                severity: Severity::Critical,
                escalated: false
            }]
        );
        assert!(
            fired[0].summary.contains("n1 has sent nothing for 6 s"),
            "{}",
            fired[0].summary
        );
        let back = e.observe_device(&device(8000, GIB, None));
        assert_eq!(
            transitions(&back, "agent_silent"),
            vec![Transition::Resolved]
        );
    }
}
