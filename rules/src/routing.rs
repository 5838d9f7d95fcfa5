//! Who hears of an alert: its owning team, named from its labels, and the
//! route table that sends it to notification channels by label matchers.
//!
//! Routes are tried in order; the first that matches takes the alert, and
//! one with `continue = true` lets the next ones match too. An alert no
//! route takes goes to `default_channels`, or, where none are given, to every
//! channel, so that an alert is never dropped for want of a route. Each
//! channel's `min_severity` still applies after routing.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::config::{NotifyConfig, RulesError, Severity};
use crate::observation::POD_LABEL_PREFIX;

/// The labels a route can match: those the rules put on alerts
/// (`engine.rs`, `rules/xid.rs`), and `rule`, `severity` and `team`. A
/// matcher on any other would never match, silently.
pub const ROUTABLE_LABELS: [&str; 16] = [
    "node",
    "gpu",
    "device_uuid",
    "mig_profile",
    "pid",
    "process",
    "user",
    "job",
    "account",
    "pod",
    "namespace",
    "container",
    "xid",
    "rule",
    "severity",
    "team",
];

/// A label some alert can carry: one of [`ROUTABLE_LABELS`], or a pod label
/// the agents forward (`pod_label.team`).
fn is_routable(label: &str) -> bool {
    ROUTABLE_LABELS.contains(&label)
        || label
            .strip_prefix(POD_LABEL_PREFIX)
            .is_some_and(|key| !key.is_empty())
}

/// The `rule` a route matches to send job memory reports.
pub const JOB_REPORT_RULE: &str = "job_report";

/// One accepted value, or any of several.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Accepted {
    One(String),
    Any(Vec<String>),
}

impl Accepted {
    fn accepts(&self, value: &str) -> bool {
        match self {
            Self::One(v) => v == value,
            Self::Any(vs) => vs.iter().any(|v| v == value),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Label → accepted value(s); every matcher must match. `rule`,
    /// `severity` and `team` can be matched beside the alert's own labels.
    /// No matchers: every alert.
    #[serde(default)]
    pub matchers: BTreeMap<String, Accepted>,
    pub channels: Vec<String>,
    #[serde(default, rename = "continue")]
    pub continue_matching: bool,
}

impl Route {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.matchers
            .iter()
            .all(|(k, accepted)| labels.get(k).is_some_and(|v| accepted.accepts(v)))
    }
}

/// Slurm account, Kubernetes namespace, user and node → team. A process's
/// alert takes the team of its job's account or its pod's namespace (the
/// cluster's own grouping of work), else of its user; an alert of a whole
/// GPU, which names no process, its node's.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OwnerMap {
    pub accounts: BTreeMap<String, String>,
    pub namespaces: BTreeMap<String, String>,
    pub users: BTreeMap<String, String>,
    pub nodes: BTreeMap<String, String>,
}

/// The first of `maps` (label, label value → team) that names a team for
/// `labels`.
fn first_team<'a>(
    maps: [(&str, &'a BTreeMap<String, String>); 4],
    labels: &BTreeMap<String, String>,
) -> Option<&'a str> {
    maps.into_iter()
        .find_map(|(label, map)| map.get(labels.get(label)?))
        .map(String::as_str)
}

impl OwnerMap {
    /// Parses an owners file (`[accounts]`, `[namespaces]`, `[users]` and
    /// `[nodes]` tables); `path` only names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, RulesError> {
        toml::from_str(text).map_err(|e| RulesError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Adds `other`'s entries that this map does not already have.
    pub fn extend_missing(&mut self, other: OwnerMap) {
        for (mine, theirs) in [
            (&mut self.accounts, other.accounts),
            (&mut self.namespaces, other.namespaces),
            (&mut self.users, other.users),
            (&mut self.nodes, other.nodes),
        ] {
            for (key, team) in theirs {
                mine.entry(key).or_insert(team);
            }
        }
    }
}

/// `[notify.owners]`: the map written in the rules file, and where to read
/// more of it.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OwnersConfig {
    /// A pod label whose value is the team (`team` for pods labelled
    /// `team: vision`); the agents must forward it (`pod_labels`).
    pub team_pod_label: Option<String>,
    pub accounts: BTreeMap<String, String>,
    pub namespaces: BTreeMap<String, String>,
    pub users: BTreeMap<String, String>,
    pub nodes: BTreeMap<String, String>,
    /// An owners file with the same four tables, read with the rules file
    /// (and again on reload); entries written here win over the file's.
    pub file: Option<std::path::PathBuf>,
}

impl OwnersConfig {
    /// The team owning an alert with these labels: its pod's own team label
    /// where [`Self::team_pod_label`] names one, else the map's team of its
    /// account, its namespace, its user, then its node.
    pub fn team<'a>(&'a self, labels: &'a BTreeMap<String, String>) -> Option<&'a str> {
        if let Some(key) = &self.team_pod_label
            && let Some(team) = labels
                .get(&format!("{POD_LABEL_PREFIX}{key}"))
                .filter(|t| !t.is_empty())
        {
            return Some(team);
        }
        first_team(
            [
                ("account", &self.accounts),
                ("namespace", &self.namespaces),
                ("user", &self.users),
                ("node", &self.nodes),
            ],
            labels,
        )
    }

    /// Takes in an owners file's entries that the rules file does not set.
    pub fn extend_missing(&mut self, file: OwnerMap) {
        let mut map = OwnerMap {
            accounts: std::mem::take(&mut self.accounts),
            namespaces: std::mem::take(&mut self.namespaces),
            users: std::mem::take(&mut self.users),
            nodes: std::mem::take(&mut self.nodes),
        };
        map.extend_missing(file);
        self.accounts = map.accounts;
        self.namespaces = map.namespaces;
        self.users = map.users;
        self.nodes = map.nodes;
    }
}

/// Why a channel takes an alert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The route at this index (0-based) in `[[notify.route]]`.
    Route(usize),
    /// No route took it: `default_channels`.
    Default,
    /// No route took it and there is no `default_channels`: every channel.
    Everyone,
}

impl NotifyConfig {
    /// Every channel: its name, kind and `min_severity`.
    pub fn channels(&self) -> Vec<(&str, &'static str, Severity)> {
        let webhook = self
            .webhook
            .iter()
            .map(|c| (c.name.as_str(), "webhook", c.min_severity));
        let slack = self
            .slack
            .iter()
            .map(|c| (c.name.as_str(), "slack", c.min_severity));
        let alertmanager = self
            .alertmanager
            .iter()
            .map(|c| (c.name.as_str(), "alertmanager", c.min_severity));
        let pagerduty = self
            .pagerduty
            .iter()
            .map(|c| (c.name.as_str(), "pagerduty", c.min_severity));
        webhook
            .chain(slack)
            .chain(alertmanager)
            .chain(pagerduty)
            .collect()
    }

    /// Every channel's name, in the order the file lists the kinds.
    pub fn channel_names(&self) -> Vec<&str> {
        self.channels()
            .into_iter()
            .map(|(name, _, _)| name)
            .collect()
    }

    /// The channels an alert with `labels` goes to, before their
    /// `min_severity`. `labels` should hold `rule`, `severity` and `team`
    /// beside the alert's own (see [`NotifyConfig::routing_labels`]).
    pub fn route(&self, labels: &BTreeMap<String, String>) -> Vec<(&str, Via)> {
        let mut out: Vec<(&str, Via)> = Vec::new();
        for (index, route) in self.route.iter().enumerate() {
            if !route.matches(labels) {
                continue;
            }
            for channel in &route.channels {
                if !out.iter().any(|(c, _)| c == channel) {
                    out.push((channel.as_str(), Via::Route(index)));
                }
            }
            if !route.continue_matching {
                return out;
            }
        }
        if !out.is_empty() {
            return out;
        }
        match &self.default_channels {
            Some(channels) => channels
                .iter()
                .map(|c| (c.as_str(), Via::Default))
                .collect(),
            None => self
                .channel_names()
                .into_iter()
                .map(|c| (c, Via::Everyone))
                .collect(),
        }
    }

    /// The labels routes match: the alert's own, `rule`, `severity`, and
    /// `team` where the owners map names one.
    pub fn routing_labels(
        &self,
        labels: &BTreeMap<String, String>,
        rule: &str,
        severity: &str,
    ) -> BTreeMap<String, String> {
        let mut out = labels.clone();
        if let Some(team) = self.owners.team(labels) {
            out.entry("team".to_owned())
                .or_insert_with(|| team.to_owned());
        }
        out.insert("rule".to_owned(), rule.to_owned());
        out.insert("severity".to_owned(), severity.to_owned());
        out
    }

    /// The channels a job's memory report goes to: those of the routes that
    /// name `rule = "job_report"` and match `labels` (see
    /// [`Self::job_report_labels`]), tried in order as alert routes are.
    /// Nothing else sends reports, no default and no catch-all route: a
    /// report is news for its owner, not for every pager.
    pub fn job_report_channels(&self, labels: &BTreeMap<String, String>) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        let for_reports = self.route.iter().filter(|r| {
            r.matchers
                .get("rule")
                .is_some_and(|accepted| accepted.accepts(JOB_REPORT_RULE))
        });
        for route in for_reports {
            if !route.matches(labels) {
                continue;
            }
            for channel in &route.channels {
                if !out.contains(&channel.as_str()) {
                    out.push(channel.as_str());
                }
            }
            if !route.continue_matching {
                break;
            }
        }
        out
    }

    /// What a job report's routes match: the job's owner labels (`node`,
    /// `job` or `pod`, and `user`, `account`, `namespace` where the job had
    /// one of each), `rule = "job_report"`, `severity = "info"` and `team`.
    pub fn job_report_labels(&self, owner: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        self.routing_labels(owner, JOB_REPORT_RULE, Severity::Info.as_str())
    }

    /// Whether `channel` takes an alert with these routing labels.
    pub fn routes_to(&self, channel: &str, labels: &BTreeMap<String, String>) -> bool {
        self.route(labels).iter().any(|(c, _)| *c == channel)
    }

    pub(crate) fn validate_routes(&self) -> Result<(), String> {
        let names = self.channel_names();
        let known = |c: &String| names.contains(&c.as_str());
        for (index, route) in self.route.iter().enumerate() {
            if route.channels.is_empty() {
                return Err(format!(
                    "notify.route[{index}]: channels is empty: name the channels it sends to"
                ));
            }
            if let Some(label) = route.matchers.keys().find(|k| !is_routable(k)) {
                return Err(format!(
                    "notify.route[{index}]: no alert has a label {label:?}: match one of {ROUTABLE_LABELS:?} or {POD_LABEL_PREFIX}<key> for a forwarded pod label"
                ));
            }
            if let Some(c) = route.channels.iter().find(|c| !known(c)) {
                return Err(format!(
                    "notify.route[{index}]: channel {c:?} is not configured (channels: {names:?})"
                ));
            }
        }
        if self.default_channels.as_ref().is_some_and(Vec::is_empty) {
            return Err(
                "notify.default_channels is empty: alerts no route takes would go nowhere \
                 (leave it out to send them to every channel)"
                    .into(),
            );
        }
        if let Some(c) = self.default_channels.iter().flatten().find(|c| !known(c)) {
            return Err(format!(
                "notify.default_channels: channel {c:?} is not configured (channels: {names:?})"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RulesConfig;

    fn notify(text: &str) -> NotifyConfig {
        RulesConfig::parse(text, Path::new("rules.toml"))
            .map_err(|e| e.to_string())
            .unwrap()
            .notify
    }

    const CHANNELS: &str = "\
[[notify.webhook]]\nname = \"ops\"\nurl = \"https://ops\"\nsecret = \"s\"\n\
[[notify.slack]]\nname = \"vision-slack\"\nwebhook_url = \"https://slack\"\n\
[[notify.pagerduty]]\nname = \"vision-pager\"\nrouting_key = \"k\"\n";

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn channels<'a>(config: &'a NotifyConfig, pairs: &[(&str, &str)]) -> Vec<(&'a str, Via)> {
        config.route(&labels(pairs))
    }

    #[test]
    fn without_routes_every_channel_takes_every_alert() {
        let c = notify(CHANNELS);
        assert_eq!(
            channels(&c, &[("node", "n1")]),
            vec![
                ("ops", Via::Everyone),
                ("vision-slack", Via::Everyone),
                ("vision-pager", Via::Everyone)
            ]
        );
    }

    #[test]
    fn the_first_matching_route_takes_the_alert_unless_it_continues() {
        let c = notify(&format!(
            "{CHANNELS}\
             [notify]\ndefault_channels = [\"ops\"]\n\
             [[notify.route]]\nmatchers = {{ team = \"vision\", severity = \"critical\" }}\n\
             channels = [\"vision-pager\"]\ncontinue = true\n\
             [[notify.route]]\nmatchers = {{ team = \"vision\" }}\nchannels = [\"vision-slack\"]\n\
             [[notify.route]]\nmatchers = {{ severity = [\"warning\", \"critical\"] }}\nchannels = [\"ops\"]\n"
        ));
        assert_eq!(
            channels(&c, &[("team", "vision"), ("severity", "critical")]),
            vec![
                ("vision-pager", Via::Route(0)),
                ("vision-slack", Via::Route(1))
            ]
        );
        assert_eq!(
            channels(&c, &[("team", "vision"), ("severity", "warning")]),
            vec![("vision-slack", Via::Route(1))]
        );
        assert_eq!(
            channels(&c, &[("team", "nlp"), ("severity", "warning")]),
            vec![("ops", Via::Route(2))]
        );
        assert_eq!(
            channels(&c, &[("team", "nlp"), ("severity", "info")]),
            vec![("ops", Via::Default)]
        );
    }

    #[test]
    fn with_routes_but_no_default_an_unmatched_alert_still_reaches_everyone() {
        let c = notify(&format!(
            "{CHANNELS}[[notify.route]]\nmatchers = {{ team = \"vision\" }}\nchannels = [\"vision-slack\"]\n"
        ));
        assert_eq!(channels(&c, &[("team", "nlp")]).len(), 3);
        assert!(c.routes_to("vision-slack", &labels(&[("team", "vision")])));
        assert!(!c.routes_to("ops", &labels(&[("team", "vision")])));
    }

    #[test]
    fn owners_name_the_team_by_user_first_then_by_node() {
        let c = notify(
            "[notify.owners]\nusers = { carol = \"vision\" }\nnodes = { gpu-a01 = \"infra\" }\n",
        );
        let process = c.routing_labels(
            &labels(&[("node", "gpu-a01"), ("user", "carol")]),
            "leak",
            "warning",
        );
        assert_eq!(process["team"], "vision");
        assert_eq!(process["rule"], "leak");
        assert_eq!(process["severity"], "warning");
        let device = c.routing_labels(&labels(&[("node", "gpu-a01")]), "watermark", "critical");
        assert_eq!(device["team"], "infra");
        let unknown = c.routing_labels(&labels(&[("node", "gpu-b07")]), "watermark", "critical");
        assert!(!unknown.contains_key("team"));
    }

    #[test]
    fn a_pods_own_team_label_names_its_team_first_and_routes_may_match_pod_labels() {
        let c = notify(&format!(
            "{CHANNELS}[notify.owners]\nteam_pod_label = \"team\"\nnamespaces = {{ serving = \"inference\" }}\n\
             [[notify.route]]\nmatchers = {{ \"pod_label.app\" = \"vllm\" }}\nchannels = [\"ops\"]\n"
        ));
        let team = |pairs: &[(&str, &str)]| {
            c.routing_labels(&labels(pairs), "leak", "warning")
                .get("team")
                .cloned()
        };
        let serving = ("namespace", "serving");
        assert_eq!(
            team(&[serving, ("pod_label.team", "speech")]).as_deref(),
            Some("speech")
        );
        assert_eq!(
            team(&[serving, ("pod_label.team", "")]).as_deref(),
            Some("inference")
        );
        assert!(c.routes_to("ops", &labels(&[("pod_label.app", "vllm")])));
        let refused = RulesConfig::parse(
            &format!("{CHANNELS}[[notify.route]]\nmatchers = {{ \"pod_label.\" = \"x\" }}\nchannels = [\"ops\"]\n"),
            Path::new("rules.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(refused.contains("pod_label.<key>"), "{refused}");
    }

    #[test]
    fn job_reports_go_only_where_a_route_names_them() {
        let c = notify(&format!(
            "{CHANNELS}[notify.owners]\nusers = {{ carol = \"vision\" }}\n\
             [[notify.route]]\nmatchers = {{ team = \"vision\" }}\nchannels = [\"vision-slack\"]\n\
             [[notify.route]]\nmatchers = {{ rule = \"job_report\", team = \"vision\" }}\nchannels = [\"ops\"]\n\
             continue = true\n\
             [[notify.route]]\nmatchers = {{ rule = [\"leak\", \"job_report\"] }}\nchannels = [\"vision-pager\"]\n"
        ));
        let carol = c.job_report_labels(&labels(&[("user", "carol"), ("job", "77")]));
        assert_eq!(carol["rule"], "job_report");
        assert_eq!(carol["severity"], "info");
        // The first route takes vision's alerts, but names no job_report.
        assert_eq!(c.job_report_channels(&carol), vec!["ops", "vision-pager"]);
        let dave = c.job_report_labels(&labels(&[("user", "dave"), ("job", "78")]));
        assert_eq!(c.job_report_channels(&dave), vec!["vision-pager"]);
        // No route naming reports: none sent, whatever the default.
        let none = notify(CHANNELS);
        assert!(none.job_report_channels(&carol).is_empty());
    }

    #[test]
    fn a_jobs_account_or_a_pods_namespace_names_the_team_before_its_user() {
        let c = notify(
            "[notify.owners]\nusers = { carol = \"vision\" }\naccounts = { speech = \"audio\" }\n\
             namespaces = { serving = \"inference\" }\n",
        );
        let team = |pairs: &[(&str, &str)]| {
            c.routing_labels(&labels(pairs), "leak", "warning")
                .get("team")
                .cloned()
        };
        let carol = ("user", "carol");
        assert_eq!(
            team(&[carol, ("account", "speech")]).as_deref(),
            Some("audio")
        );
        assert_eq!(
            team(&[carol, ("namespace", "serving")]).as_deref(),
            Some("inference")
        );
        assert_eq!(
            team(&[carol, ("account", "unmapped")]).as_deref(),
            Some("vision")
        );
    }

    #[test]
    fn an_owners_file_adds_what_the_rules_file_does_not_say() {
        let mut map = OwnerMap {
            users: labels(&[("carol", "vision")]),
            ..OwnerMap::default()
        };
        let file = OwnerMap::parse(
            "[users]\ncarol = \"nlp\"\ndave = \"nlp\"\n[nodes]\ngpu-a01 = \"infra\"\n\
             [accounts]\nspeech = \"audio\"\n[namespaces]\nserving = \"inference\"\n",
            Path::new("owners.toml"),
        )
        .unwrap();
        map.extend_missing(file);
        assert_eq!(map.users["carol"], "vision");
        assert_eq!(map.users["dave"], "nlp");
        assert_eq!(map.nodes["gpu-a01"], "infra");
        assert_eq!(map.accounts["speech"], "audio");
        assert_eq!(map.namespaces["serving"], "inference");
        let e = OwnerMap::parse("[user]\ncarol = 1\n", Path::new("owners.toml")).unwrap_err();
        assert!(e.to_string().contains("owners.toml"), "{e}");
    }

    #[test]
    fn a_route_to_a_channel_that_does_not_exist_is_refused_by_name() {
        for (text, expected) in [
            (
                format!("{CHANNELS}[[notify.route]]\nchannels = [\"vison-slack\"]\n"),
                "notify.route[0]: channel \"vison-slack\" is not configured",
            ),
            (
                format!("{CHANNELS}[[notify.route]]\nchannels = []\n"),
                "notify.route[0]: channels is empty",
            ),
            (
                format!(
                    "{CHANNELS}[[notify.route]]\nmatchers = {{ taem = \"vision\" }}\nchannels = [\"ops\"]\n"
                ),
                "notify.route[0]: no alert has a label \"taem\"",
            ),
            (
                format!("{CHANNELS}[notify]\ndefault_channels = []\n"),
                "notify.default_channels is empty",
            ),
            (
                format!("{CHANNELS}[notify]\ndefault_channels = [\"nobody\"]\n"),
                "notify.default_channels: channel \"nobody\" is not configured",
            ),
        ] {
            let e = RulesConfig::parse(&text, Path::new("rules.toml")).unwrap_err();
            assert!(e.to_string().contains(expected), "{e}");
        }
    }
}
