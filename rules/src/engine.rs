//! Evaluates every rule on every sample as it arrives, one state machine per
//! series (GPU, MIG instance, process, node), so an alert costs one sample
//! interval, not a scrape plus an evaluation cycle. No I/O: the caller feeds
//! observations and persists the changes this returns.
//!
//! The engine knows series, not rules. It keeps each series' labels and
//! identity, hands every observation to the rules that watch that kind of
//! series (the catalogue in `rules/mod.rs`), steps each alert's lifecycle with
//! the condition its rule reports, and ends the alerts of series that go
//! away. What a rule looks for and what its alert says live in the rule's own
//! file, so adding one leaves this file alone.

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;

use crate::alert::{Alert, AlertChange, Message, RestoredAlert, Tracked, fingerprint};
use crate::allocator::{self, AllocatorObservation};
use crate::config::RulesConfig;
use crate::describe::process_name;
use crate::lifecycle::Transition;
use crate::observation::{
    DeviceObservation, EventObservation, POD_LABEL_PREFIX, ProcessObservation,
};
use crate::rule::{
    AcceptsEvent, DeviceRule, EventRule, NodeFacts, NodeRule, Outcome, ProcessFacts, ProcessRule,
    Rule, Start, StartDevice, StartEvent, StartNode, StartProcess,
};
use crate::rules::RuleId;

/// A process not seen for this long has exited; its state is dropped and its
/// alerts resolve.
pub(crate) const PROCESS_GONE_MS: i64 = 5 * 60_000;
/// Alerts restored after a restart whose series never reappears resolve
/// after this long.
const RESTORED_GRACE_MS: i64 = 10 * 60_000;

/// One rule's alert on one series, and the rule's own state for that series.
#[derive(Debug)]
struct Slot<R: ?Sized> {
    id: RuleId,
    tracked: Tracked,
    rule: Box<R>,
}

impl<R: ?Sized> Slot<R> {
    /// The rule, and the handle it judges its alert through, borrowed apart.
    fn alert<'a>(
        &'a mut self,
        labels: &'a BTreeMap<String, String>,
        out: &'a mut Vec<AlertChange>,
    ) -> (&'a mut R, Alert<'a>) {
        (
            &mut *self.rule,
            Alert::new(self.id.as_str(), &mut self.tracked, labels, out),
        )
    }
}

/// Starts every rule in `rules` on a new series, each with its alert
/// restored when the store handed one back.
fn start_slots<F: Copy, R: ?Sized>(
    rules: &[(RuleId, F)],
    identity: &[(&str, &str)],
    restored: &mut HashMap<String, RestoredAlert>,
    restored_at_ms: i64,
    start: impl Fn(F, Option<i64>) -> Box<R>,
) -> Vec<Slot<R>> {
    rules
        .iter()
        .map(|&(id, starter)| {
            let tracked = Tracked::new(fingerprint(id.as_str(), identity), restored);
            let held_since = tracked.is_active().then_some(restored_at_ms);
            Slot {
                id,
                tracked,
                rule: start(starter, held_since),
            }
        })
        .collect()
}

#[derive(Debug)]
struct DeviceSeries {
    labels: BTreeMap<String, String>,
    rules: Vec<Slot<dyn DeviceRule>>,
}

#[derive(Debug)]
struct ProcessSeries {
    labels: BTreeMap<String, String>,
    rules: Vec<Slot<dyn ProcessRule>>,
    /// The newest allocator report; older ones arriving late are ignored.
    allocator: Option<AllocatorObservation>,
    last_seen_ms: i64,
}

#[derive(Debug)]
struct NodeSeries {
    labels: BTreeMap<String, String>,
    rules: Vec<Slot<dyn NodeRule>>,
    last_seen_ms: i64,
    interval_ms: i64,
}

/// One event rule's alert on one (node, device, code).
#[derive(Debug)]
struct EventSeries {
    slot: Slot<dyn EventRule>,
    labels: BTreeMap<String, String>,
    last_event_ms: i64,
}

type EventKey = (String, String, RuleId, i64);

/// The rules the engine runs, by the kind of series they watch, each list in
/// [`RuleId::ALL`] order: the order their changes come out in.
#[derive(Debug, Default)]
struct Catalogue {
    device: Vec<(RuleId, StartDevice)>,
    process: Vec<(RuleId, StartProcess)>,
    node: Vec<(RuleId, StartNode)>,
    event: Vec<(RuleId, AcceptsEvent, StartEvent)>,
}

impl Catalogue {
    fn new(rules: impl IntoIterator<Item = (RuleId, Rule)>) -> Self {
        let mut catalogue = Self::default();
        for (id, rule) in rules {
            match rule {
                Rule::Device(start) => catalogue.device.push((id, start)),
                Rule::Process(start) => catalogue.process.push((id, start)),
                Rule::Node(start) => catalogue.node.push((id, start)),
                Rule::Event { accepts, start } => catalogue.event.push((id, accepts, start)),
            }
        }
        catalogue
    }
}

/// Series state, alert lifecycles and the rules that judge them.
#[derive(Debug)]
pub struct Engine {
    config: RulesConfig,
    catalogue: Catalogue,
    devices: HashMap<String, DeviceSeries>,
    processes: HashMap<(String, u32, i64), ProcessSeries>,
    nodes: HashMap<String, NodeSeries>,
    events: HashMap<EventKey, EventSeries>,
    restored: HashMap<String, RestoredAlert>,
    restored_at_ms: i64,
}

impl Engine {
    pub fn new(config: RulesConfig) -> Self {
        Self::with_rules(config, RuleId::ALL.iter().map(|&id| (id, id.rule())))
    }

    /// An engine running exactly `rules`; [`Engine::new`] runs the whole
    /// catalogue.
    pub(crate) fn with_rules(
        config: RulesConfig,
        rules: impl IntoIterator<Item = (RuleId, Rule)>,
    ) -> Self {
        Self {
            config,
            catalogue: Catalogue::new(rules),
            devices: HashMap::new(),
            processes: HashMap::new(),
            nodes: HashMap::new(),
            events: HashMap::new(),
            restored: HashMap::new(),
            restored_at_ms: 0,
        }
    }

    /// Replaces the rules (a reload) while keeping every series' state.
    pub fn set_config(&mut self, config: RulesConfig) {
        self.config = config;
    }

    pub fn config(&self) -> &RulesConfig {
        &self.config
    }

    /// Hands over the alerts the store holds as active (after a restart).
    pub fn restore(&mut self, alerts: Vec<RestoredAlert>, now_ms: i64) {
        self.restored_at_ms = now_ms;
        for a in alerts {
            self.restored.insert(a.fingerprint.clone(), a);
        }
    }

    pub fn observe_device(&mut self, o: &DeviceObservation<'_>) -> Vec<AlertChange> {
        let mut out = Vec::new();
        self.note_node(o.node, o.timestamp_ms, &mut out);
        self.device_reports_again(o.node, o.device_uuid, o.timestamp_ms, &mut out);
        let config = &self.config;
        let restored = &mut self.restored;
        let restored_at_ms = self.restored_at_ms;
        let catalogue = &self.catalogue;
        let series = self
            .devices
            .entry(o.device_uuid.to_owned())
            .or_insert_with(|| {
                let mut labels = BTreeMap::new();
                labels.insert("node".to_owned(), o.node.to_owned());
                labels.insert("gpu".to_owned(), o.gpu_index.to_string());
                labels.insert("device_uuid".to_owned(), o.device_uuid.to_owned());
                if let Some(p) = o.mig_profile {
                    labels.insert("mig_profile".to_owned(), p.to_owned());
                }
                let id = [("node", o.node), ("device", o.device_uuid)];
                DeviceSeries {
                    rules: start_slots(
                        &catalogue.device,
                        &id,
                        restored,
                        restored_at_ms,
                        |start, restored_at_ms| {
                            start(&Start {
                                config,
                                observation: o,
                                restored_at_ms,
                            })
                        },
                    ),
                    labels,
                }
            });
        for slot in &mut series.rules {
            let (rule, mut alert) = slot.alert(&series.labels, &mut out);
            rule.observe(config, o, &mut alert);
        }
        out
    }

    pub fn observe_process(&mut self, o: &ProcessObservation<'_>) -> Vec<AlertChange> {
        let mut out = Vec::new();
        let key = (o.device_uuid.to_owned(), o.pid, o.start_time_ms);
        let config = &self.config;
        let restored = &mut self.restored;
        let restored_at_ms = self.restored_at_ms;
        let catalogue = &self.catalogue;
        let series = self.processes.entry(key).or_insert_with(|| {
            let mut labels = BTreeMap::new();
            labels.insert("node".to_owned(), o.node.to_owned());
            labels.insert("gpu".to_owned(), o.gpu_index.to_string());
            labels.insert("device_uuid".to_owned(), o.device_uuid.to_owned());
            labels.insert("pid".to_owned(), o.pid.to_string());
            labels.insert("process".to_owned(), o.name.chars().take(120).collect());
            for (k, v) in [
                ("user", o.user),
                ("job", o.slurm_job_id),
                ("account", o.slurm_account),
                ("pod", o.pod_uid),
                ("namespace", o.pod_namespace),
                ("container", o.container_id),
            ] {
                if !v.is_empty() {
                    labels.insert(k.to_owned(), v.to_owned());
                }
            }
            for (key, value) in o.pod_labels {
                labels.insert(format!("{POD_LABEL_PREFIX}{key}"), value.clone());
            }
            let start = o.start_time_ms.to_string();
            let pid = o.pid.to_string();
            let id = [
                ("node", o.node),
                ("device", o.device_uuid),
                ("pid", pid.as_str()),
                ("start", start.as_str()),
            ];
            ProcessSeries {
                rules: start_slots(
                    &catalogue.process,
                    &id,
                    restored,
                    restored_at_ms,
                    |start, restored_at_ms| {
                        start(&Start {
                            config,
                            observation: o,
                            restored_at_ms,
                        })
                    },
                ),
                allocator: None,
                last_seen_ms: o.timestamp_ms,
                labels,
            }
        });
        series.last_seen_ms = series.last_seen_ms.max(o.timestamp_ms);
        if let Some(a) = o.allocator
            && series
                .allocator
                .is_none_or(|last| a.timestamp_ms > last.timestamp_ms)
        {
            series.allocator = Some(a);
        }
        let facts = ProcessFacts {
            last_report: series.allocator,
            report: series
                .allocator
                .filter(|a| o.timestamp_ms - a.timestamp_ms <= allocator::REPORT_STALE_MS),
        };
        for slot in &mut series.rules {
            let (rule, mut alert) = slot.alert(&series.labels, &mut out);
            rule.observe(config, o, &facts, &mut alert);
        }
        if let Some(device) = self.devices.get_mut(o.device_uuid) {
            for slot in &mut device.rules {
                slot.rule.observe_process(o);
            }
        }
        out
    }

    /// A device read again tells the one-per-device event alerts (a lost or
    /// stalled GPU) that it is back.
    fn device_reports_again(
        &mut self,
        node: &str,
        uuid: &str,
        ts_ms: i64,
        out: &mut Vec<AlertChange>,
    ) {
        // Most devices have no event alert: spare them the key allocations.
        if self.events.is_empty() {
            return;
        }
        for &(id, _, _) in &self.catalogue.event {
            let key = (node.to_owned(), uuid.to_owned(), id, 0);
            let Some(series) = self.events.get_mut(&key) else {
                continue;
            };
            let (rule, mut alert) = series.slot.alert(&series.labels, out);
            if rule.device_reports(ts_ms, series.last_event_ms, &mut alert) == Outcome::Close {
                self.events.remove(&key);
            }
        }
    }

    pub fn observe_event(&mut self, e: &EventObservation<'_>) -> Vec<AlertChange> {
        let mut out = Vec::new();
        let device = e.device_uuid.unwrap_or("");
        for &(id, accepts, start) in &self.catalogue.event {
            let Some(code) = accepts(&self.config, e) else {
                continue;
            };
            let key = (e.node.to_owned(), device.to_owned(), id, code);
            let restored = &mut self.restored;
            let series = self.events.entry(key).or_insert_with(|| {
                let mut labels = BTreeMap::new();
                labels.insert("node".to_owned(), e.node.to_owned());
                if let Some(index) = e.gpu_index {
                    labels.insert("gpu".to_owned(), index.to_string());
                }
                if !device.is_empty() {
                    labels.insert("device_uuid".to_owned(), device.to_owned());
                }
                let rule = start(code);
                rule.label(&mut labels);
                let code_text = code.to_string();
                let identity = [
                    ("node", e.node),
                    ("device", device),
                    ("code", code_text.as_str()),
                ];
                EventSeries {
                    slot: Slot {
                        id,
                        tracked: Tracked::new(fingerprint(id.as_str(), &identity), restored),
                        rule,
                    },
                    labels,
                    last_event_ms: e.timestamp_ms,
                }
            });
            series.last_event_ms = series.last_event_ms.max(e.timestamp_ms);
            let (rule, mut alert) = series.slot.alert(&series.labels, &mut out);
            rule.observe(&self.config, e, &mut alert);
        }
        out
    }

    fn node_series<'a>(
        nodes: &'a mut HashMap<String, NodeSeries>,
        catalogue: &Catalogue,
        restored: &mut HashMap<String, RestoredAlert>,
        restored_at_ms: i64,
        node: &str,
        seen_ms: i64,
        interval_ms: i64,
    ) -> &'a mut NodeSeries {
        nodes.entry(node.to_owned()).or_insert_with(|| NodeSeries {
            labels: BTreeMap::from([("node".to_owned(), node.to_owned())]),
            rules: start_slots(
                &catalogue.node,
                &[("node", node)],
                restored,
                restored_at_ms,
                |start, _| start(),
            ),
            last_seen_ms: seen_ms,
            interval_ms,
        })
    }

    /// Records a node's sample interval (from its registration).
    pub fn node_registered(&mut self, node: &str, interval_ms: i64, now_ms: i64) {
        let series = Self::node_series(
            &mut self.nodes,
            &self.catalogue,
            &mut self.restored,
            self.restored_at_ms,
            node,
            now_ms,
            interval_ms,
        );
        series.interval_ms = interval_ms.max(1);
        series.last_seen_ms = series.last_seen_ms.max(now_ms);
    }

    fn note_node(&mut self, node: &str, ts_ms: i64, out: &mut Vec<AlertChange>) {
        // Until the node registers, assume the agent's default interval.
        let series = Self::node_series(
            &mut self.nodes,
            &self.catalogue,
            &mut self.restored,
            self.restored_at_ms,
            node,
            ts_ms,
            1000,
        );
        series.last_seen_ms = series.last_seen_ms.max(ts_ms);
        let facts = NodeFacts {
            node,
            last_seen_ms: series.last_seen_ms,
            interval_ms: series.interval_ms,
        };
        for slot in &mut series.rules {
            let (rule, mut alert) = slot.alert(&series.labels, out);
            rule.heard(&self.config, &facts, ts_ms, &mut alert);
        }
    }

    /// Time-driven rules (silent agents, events that stopped recurring),
    /// exited processes, restored alerts whose series never came back. Call
    /// about once a second.
    pub fn tick(&mut self, now_ms: i64) -> Vec<AlertChange> {
        let mut out = Vec::new();
        for (node, series) in &mut self.nodes {
            let facts = NodeFacts {
                node,
                last_seen_ms: series.last_seen_ms,
                interval_ms: series.interval_ms,
            };
            for slot in &mut series.rules {
                let (rule, mut alert) = slot.alert(&series.labels, &mut out);
                rule.tick(&self.config, &facts, now_ms, &mut alert);
            }
        }
        let gone = self
            .processes
            .extract_if(|_, p| now_ms - p.last_seen_ms > PROCESS_GONE_MS);
        for (_, mut p) in gone {
            let labels = &p.labels;
            for slot in &mut p.rules {
                let (_, mut alert) = slot.alert(labels, &mut out);
                alert.step(now_ms, None, 0, || {
                    Message::new(
                        format!("{} exited", process_name(labels)),
                        serde_json::json!({}),
                    )
                });
            }
        }
        let mut ended = Vec::new();
        for (key, series) in &mut self.events {
            let (rule, mut alert) = series.slot.alert(&series.labels, &mut out);
            if rule.tick(&self.config, now_ms, series.last_event_ms, &mut alert) == Outcome::Close {
                ended.push(key.clone());
            }
        }
        for key in ended {
            self.events.remove(&key);
        }
        if !self.restored.is_empty() && now_ms - self.restored_at_ms > RESTORED_GRACE_MS {
            for (_, r) in self.restored.drain() {
                // An alert of a rule this build no longer has still closes.
                let rule = RuleId::from_str(&r.rule).map_or("unknown", RuleId::as_str);
                out.push(AlertChange {
                    fingerprint: r.fingerprint,
                    rule,
                    transition: if r.firing {
                        Transition::Resolved
                    } else {
                        Transition::Withdrawn
                    },
                    severity: r.severity,
                    at_ms: now_ms,
                    labels: r.labels,
                    summary: "no data for this series since the collector restarted".into(),
                    details: serde_json::json!({}),
                    remedy: String::new(),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Severity;
    use crate::engine_fixtures::{GIB, device, rules, transitions};

    #[test]
    fn restored_firing_alert_is_not_announced_again_and_resolves_later() {
        let id = [("node", "n1"), ("device", "GPU-1")];
        let mut e = Engine::new(rules(""));
        e.restore(
            vec![RestoredAlert {
                fingerprint: fingerprint("watermark", &id),
                rule: "watermark".into(),
                severity: Severity::Warning,
                firing: true,
                since_ms: 0,
                labels: BTreeMap::new(),
            }],
            0,
        );
        let still = e.observe_device(&device(1000, 92 * GIB, None));
        assert!(transitions(&still, "watermark").is_empty(), "{still:?}");
        let cleared = e.observe_device(&device(2000, 50 * GIB, None));
        assert_eq!(
            transitions(&cleared, "watermark"),
            vec![Transition::Resolved]
        );
    }

    #[test]
    fn reloading_rules_keeps_alert_state() {
        let mut e = Engine::new(rules(""));
        let fired = e.observe_device(&device(0, 92 * GIB, None));
        assert_eq!(transitions(&fired, "watermark").len(), 1);
        e.set_config(rules(
            "[watermark]\nwarning = 0.8\ncritical = 0.97\nclear_below = 0.7\n",
        ));
        let after = e.observe_device(&device(1000, 92 * GIB, None));
        assert!(
            transitions(&after, "watermark").is_empty(),
            "not announced again: {after:?}"
        );
        // The new hysteresis applies: 75 % no longer clears.
        assert!(e.observe_device(&device(2000, 75 * GIB, None)).is_empty());
        let cleared = e.observe_device(&device(3000, 60 * GIB, None));
        assert_eq!(
            transitions(&cleared, "watermark"),
            vec![Transition::Resolved]
        );
        assert_eq!(
            cleared[0].severity,
            Severity::Warning,
            "resolved with the severity it fired at, so it reaches the same channels"
        );
    }

    #[test]
    fn fingerprints_are_stable_and_distinct() {
        let a = fingerprint("leak", &[("node", "n1"), ("pid", "5")]);
        assert_eq!(a, fingerprint("leak", &[("node", "n1"), ("pid", "5")]));
        assert_ne!(a, fingerprint("leak", &[("node", "n1"), ("pid", "6")]));
        assert_ne!(a, fingerprint("watermark", &[("node", "n1"), ("pid", "5")]));
        assert_eq!(a.len(), 24);
    }

    #[test]
    fn fingerprints_match_those_already_stored() {
        // Pinned values (SHA-256 of the rule's name and the series identity,
        // computed outside Rust): alerts in existing stores carry these, and
        // a restart must find them again.
        let mut e = Engine::new(rules(""));
        let watermark = e.observe_device(&device(0, 92 * GIB, None));
        assert_eq!(watermark[0].rule, "watermark");
        assert_eq!(watermark[0].fingerprint, "18b605bea64f7c75cafba5be");
        let xid = e.observe_event(&crate::engine_fixtures::event("xid", 79, 0));
        assert_eq!(xid[0].fingerprint, "cb7a06cbfb0f34f53189707f");
        assert_eq!(
            fingerprint(
                RuleId::Leak.as_str(),
                &[
                    ("node", "n1"),
                    ("device", "GPU-1"),
                    ("pid", "4242"),
                    ("start", "0")
                ]
            ),
            "eb46929a761b875e9929fd8e"
        );
    }

    #[test]
    fn a_restored_alert_of_an_unknown_rule_still_closes() {
        let mut e = Engine::new(rules(""));
        e.restore(
            vec![RestoredAlert {
                fingerprint: "f".into(),
                rule: "retired_rule".into(),
                severity: Severity::Warning,
                firing: true,
                since_ms: 0,
                labels: BTreeMap::new(),
            }],
            0,
        );
        let closed = e.tick(RESTORED_GRACE_MS + 1);
        assert_eq!(closed.len(), 1);
        assert_eq!(closed[0].rule, "unknown");
        assert_eq!(closed[0].transition, Transition::Resolved);
    }

    /// A rule written the way the catalogue's are, known to nothing but
    /// this test: warns when a GPU is more than half full, with a remedy.
    #[derive(Debug)]
    struct HalfFull {
        samples: u32,
    }

    impl DeviceRule for HalfFull {
        fn start(_: &Start<'_, DeviceObservation<'_>>) -> Self {
            Self { samples: 0 }
        }

        fn observe(&mut self, _: &RulesConfig, o: &DeviceObservation<'_>, alert: &mut Alert<'_>) {
            self.samples += 1;
            let condition = (o.used_last * 2 > o.total).then_some(Severity::Warning);
            let samples = self.samples;
            alert.step_with_remedy(
                o.timestamp_ms,
                condition,
                2000,
                || {
                    Message::new(
                        format!("half full after {samples} samples"),
                        serde_json::json!({}),
                    )
                },
                || "free some".to_owned(),
            );
        }
    }

    #[test]
    fn a_new_rule_needs_no_change_to_the_engine() {
        // Registered the way `RuleId::rule` registers every rule, under a
        // name of the catalogue since names are what alerts are stored by.
        let mut e = Engine::with_rules(
            rules(""),
            [(RuleId::Unattributed, Rule::device::<HalfFull>())],
        );
        let mut all = Vec::new();
        for (t, used) in [(0, 40), (1000, 60), (2000, 60), (3000, 60), (4000, 30)] {
            all.extend(e.observe_device(&device(t, used * GIB, None)));
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
                Transition::Resolved,
            ],
            "its `for` of 2 s held by the lifecycle, not by the rule: {all:?}"
        );
        assert_eq!(all.len(), 3, "no other rule runs: {all:?}");
        assert_eq!(all[1].summary, "half full after 4 samples");
        assert_eq!(all[1].remedy, "free some");
        assert_eq!(all[2].remedy, "", "no advice on resolution");
        assert_eq!(
            all[1].fingerprint,
            fingerprint("unattributed", &[("node", "n1"), ("device", "GPU-1")])
        );
        assert_eq!(all[1].labels["gpu"], "1");
    }
}
