//! Keeps Alertmanager (API v2) informed of Headroom's alerts the way
//! Prometheus does: the current state, every firing alert and every alert
//! resolved in the last 15 minutes, is pushed to each listed instance as soon
//! as an alert fires or resolves, and again every resend interval.
//!
//! Pushing state rather than transitions needs no outbox: Alertmanager keys
//! alerts by their labels, so a push that fails is made whole by the next,
//! an Alertmanager that restarts empty is refilled within one interval, and
//! collectors sharing a database may all push without duplicating a page.
//! A firing alert is sent valid for four intervals, so Alertmanager resolves
//! it by itself if Headroom stops sending.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde_json::{Map, Value};
use tokio::sync::watch;

use super::{Alerting, is_silenced, parse_severity, render};
use headroom_rules::config::{NotifyConfig, Severity};
use headroom_store::alerts::{AlertFilter, AlertView, SilenceView};

/// How long a resolved alert keeps being sent with its end, so that every
/// instance hears of it even across a short outage (Prometheus: 15 min).
const RESOLVED_RETENTION_MS: i64 = 15 * 60_000;
/// How soon a failed push is tried again, unless the interval is shorter.
const RETRY_MS: i64 = 5_000;
/// A firing alert is valid for this many resend intervals.
const VALIDITY_INTERVALS: i64 = 4;

#[derive(Clone)]
pub struct Target {
    pub name: String,
    urls: Vec<String>,
    min_severity: Severity,
    resend_interval_ms: i64,
}

// A URL may carry basic-auth credentials.
impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("name", &self.name)
            .field("urls", &self.urls.len())
            .finish_non_exhaustive()
    }
}

pub fn targets(config: &NotifyConfig) -> Vec<Target> {
    config
        .alertmanager
        .iter()
        .map(|a| Target {
            name: a.name.clone(),
            urls: a
                .urls
                .iter()
                .map(|u| format!("{}/api/v2/alerts", u.trim_end_matches('/')))
                .collect(),
            min_severity: a.min_severity,
            resend_interval_ms: a.resend_interval.ms(),
        })
        .collect()
}

/// Alertmanager's label names are `[a-zA-Z_][a-zA-Z0-9_]*`. Headroom's
/// `job` (the Slurm job) becomes `slurm_job`: in Alertmanager `job` is the
/// Prometheus scrape job, and routes written for it must not match a job id.
/// Its `account` (the Slurm job's) becomes `slurm_account` beside it.
fn label_name(key: &str) -> String {
    match key {
        "job" => return "slurm_job".to_owned(),
        "account" => return "slurm_account".to_owned(),
        _ => {}
    }
    let mut name: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        name.insert(0, '_');
    }
    name
}

fn labels(alert: &AlertView) -> Map<String, Value> {
    let mut out = Map::new();
    if let Some(own) = alert.labels.as_object() {
        for (key, value) in own {
            // An empty value is the same as no label to Alertmanager.
            match value {
                Value::String(s) if !s.is_empty() => {
                    out.insert(label_name(key), Value::String(s.clone()));
                }
                Value::String(_) | Value::Null => {}
                other => {
                    out.insert(label_name(key), Value::String(other.to_string()));
                }
            }
        }
    }
    out.insert("alertname".to_owned(), alert.rule.clone().into());
    out.insert("rule".to_owned(), alert.rule.clone().into());
    out.insert("severity".to_owned(), alert.severity.clone().into());
    out
}

fn annotations(alert: &AlertView, link: Option<&str>) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("summary".to_owned(), alert.summary.clone().into());
    if !alert.remedy.is_empty() {
        out.insert("remedy".to_owned(), alert.remedy.clone().into());
    }
    if let Some(link) = link {
        out.insert("dashboard".to_owned(), link.into());
    }
    if alert.details.as_object().is_some_and(|d| !d.is_empty()) {
        out.insert("details".to_owned(), alert.details.to_string().into());
    }
    if let Some(by) = &alert.acknowledged_by {
        out.insert("acknowledged_by".to_owned(), by.clone().into());
    }
    out
}

/// The alerts of `POST /api/v2/alerts` for one Alertmanager channel, each
/// with its Headroom fingerprint: firing alerts valid until `now_ms +
/// valid_for_ms`, resolved ones with their end. Alerts below the channel's
/// severity or under a Headroom silence are left out (a silence made after
/// an alert was sent lets it expire there).
pub fn payload(
    alerts: &[AlertView],
    silences: &[SilenceView],
    target: &Target,
    routing: &NotifyConfig,
    now_ms: i64,
    dashboard: Option<&str>,
) -> Vec<(String, Value)> {
    let valid_for_ms = VALIDITY_INTERVALS * target.resend_interval_ms;
    alerts
        .iter()
        .filter(|a| parse_severity(&a.severity) >= target.min_severity)
        .filter(|a| routes_here(routing, &target.name, a))
        .filter(|a| !is_silenced(silences, &a.rule, &a.labels))
        .filter_map(|a| {
            let ends_at_ms = match (a.state.as_str(), a.resolved_at_ms) {
                ("firing", _) => now_ms + valid_for_ms,
                ("resolved", Some(at)) if at >= now_ms - RESOLVED_RETENTION_MS => at,
                _ => return None,
            };
            let starts_at_ms = a.fired_at_ms.unwrap_or(a.started_at_ms);
            let device = a.labels.get("device_uuid").and_then(Value::as_str);
            let link = render::dashboard_link_at(dashboard, device, starts_at_ms);
            let mut alert = Map::new();
            alert.insert("labels".to_owned(), labels(a).into());
            alert.insert(
                "annotations".to_owned(),
                annotations(a, link.as_deref()).into(),
            );
            if let Some(at) = render::rfc3339(starts_at_ms) {
                alert.insert("startsAt".to_owned(), at.into());
            }
            if let Some(at) = render::rfc3339(ends_at_ms) {
                alert.insert("endsAt".to_owned(), at.into());
            }
            if let Some(link) = link {
                alert.insert("generatorURL".to_owned(), link.into());
            }
            Some((a.fingerprint.clone(), Value::Object(alert)))
        })
        .collect()
}

/// What one channel last sent, so that an alert whose labels changed (an
/// escalation changes `severity`) ends its old label set at once: to
/// Alertmanager the two are different alerts, and the old one would stay
/// active until it expired.
#[derive(Debug, Default)]
struct Sent {
    labels_by_fingerprint: HashMap<String, Value>,
    /// Label sets replaced, each with when it ended, sent as resolved for as
    /// long as a resolved alert is.
    superseded: Vec<(i64, Value)>,
}

impl Sent {
    /// The body to send now: `current`, and every superseded label set.
    fn body(&mut self, current: Vec<(String, Value)>, now_ms: i64) -> Vec<Value> {
        let ended_at = render::rfc3339(now_ms);
        for (fingerprint, alert) in &current {
            let Some(previous) = self.labels_by_fingerprint.get(fingerprint) else {
                continue;
            };
            if *previous != alert["labels"] {
                let mut ended = alert.clone();
                ended["labels"] = previous.clone();
                if let Some(at) = &ended_at {
                    ended["endsAt"] = at.as_str().into();
                }
                self.superseded.push((now_ms, ended));
            }
        }
        // An ended label set that is current again (a warning that came
        // back) must not be sent as ended beside it.
        let current_labels: Vec<&Value> = current.iter().map(|(_, a)| &a["labels"]).collect();
        self.superseded.retain(|(at, ended)| {
            *at >= now_ms - RESOLVED_RETENTION_MS && !current_labels.contains(&&ended["labels"])
        });
        self.labels_by_fingerprint = current
            .iter()
            .map(|(f, a)| (f.clone(), a["labels"].clone()))
            .collect();
        current
            .into_iter()
            .map(|(_, a)| a)
            .chain(self.superseded.iter().map(|(_, a)| a.clone()))
            .collect()
    }
}

/// Whether the route table sends `alert` to the channel `name`.
fn routes_here(routing: &NotifyConfig, name: &str, alert: &AlertView) -> bool {
    let own: BTreeMap<String, String> = alert
        .labels
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    routing.routes_to(
        name,
        &routing.routing_labels(&own, &alert.rule, &alert.severity),
    )
}

/// What every push reads: firing alerts, recently resolved ones, silences.
async fn current_state(
    alerting: &Alerting,
    now_ms: i64,
) -> Result<(Vec<AlertView>, Vec<SilenceView>), headroom_store::StoreError> {
    let mut alerts = alerting.store.alerts(AlertFilter::Firing, 100_000).await?;
    // Newest first: stop at the first one resolved too long ago.
    let resolved = alerting.store.alerts(AlertFilter::Resolved, 10_000).await?;
    alerts.extend(
        resolved
            .into_iter()
            .take_while(|a| a.updated_at_ms >= now_ms - RESOLVED_RETENTION_MS),
    );
    let silences = alerting.store.silences(now_ms).await?;
    Ok((newest_per_fingerprint(alerts), silences))
}

/// One row per alert: an alert that fired again after it resolved has a
/// resolved row and a firing one, and Alertmanager, given both, would keep
/// whichever came last. The newer row (the higher id) is the alert's state.
fn newest_per_fingerprint(alerts: Vec<AlertView>) -> Vec<AlertView> {
    let mut newest: HashMap<String, AlertView> = HashMap::new();
    for alert in alerts {
        match newest.get(&alert.fingerprint) {
            Some(kept) if kept.id >= alert.id => {}
            _ => {
                newest.insert(alert.fingerprint.clone(), alert);
            }
        }
    }
    let mut out: Vec<AlertView> = newest.into_values().collect();
    out.sort_by_key(|a| a.id);
    out
}

/// Sends `body` to every instance of `target`; true when all accepted.
async fn push(http: &reqwest::Client, target: &Target, body: &[Value]) -> bool {
    let sends = target
        .urls
        .iter()
        .enumerate()
        .map(|(index, url)| async move {
            let outcome = match http.post(url).json(body).send().await {
                Ok(r) if r.status().is_success() => return true,
                Ok(r) => format!("Alertmanager answered HTTP {}", r.status()),
                // reqwest errors can carry the URL, which may hold credentials.
                Err(e) => format!("request failed: {}", e.without_url()),
            };
            tracing::warn!(channel = %target.name, instance = index, error = %outcome,
            alerts = body.len(), "pushing alerts to Alertmanager failed");
            false
        });
    join_all(sends).await.into_iter().all(|ok| ok)
}

pub(super) async fn sync(alerting: Arc<Alerting>, mut stop: watch::Receiver<bool>) {
    let http = super::channels::http_client();
    // When each channel is next due; a change makes every channel due.
    let mut next_due_ms: HashMap<String, i64> = HashMap::new();
    let mut sent: HashMap<String, Sent> = HashMap::new();
    let mut changed = false;
    loop {
        let targets = alerting
            .alertmanagers
            .read()
            .map(|t| t.clone())
            .unwrap_or_default();
        let now = alerting.clock.now_ms();
        let due: Vec<&Target> = targets
            .iter()
            .filter(|t| changed || next_due_ms.get(&t.name).is_none_or(|&d| now >= d))
            .collect();
        if !due.is_empty() {
            let dashboard = alerting
                .engine
                .lock()
                .ok()
                .and_then(|e| e.config().notify.dashboard_url.clone());
            let routing = alerting.routing();
            match current_state(&alerting, now).await {
                Ok((alerts, silences)) => {
                    for target in due {
                        let interval = target.resend_interval_ms;
                        let current = payload(
                            &alerts,
                            &silences,
                            target,
                            &routing,
                            now,
                            dashboard.as_deref(),
                        );
                        let body = sent
                            .entry(target.name.clone())
                            .or_default()
                            .body(current, now);
                        let ok = body.is_empty() || push(&http, target, &body).await;
                        let wait = if ok { interval } else { interval.min(RETRY_MS) };
                        next_due_ms.insert(target.name.clone(), now + wait);
                    }
                }
                Err(error) => {
                    tracing::error!(%error, "reading alerts for Alertmanager failed");
                    for target in due {
                        next_due_ms.insert(target.name.clone(), now + RETRY_MS);
                    }
                }
            }
        }
        let names: BTreeMap<&str, ()> = targets.iter().map(|t| (t.name.as_str(), ())).collect();
        next_due_ms.retain(|name, _| names.contains_key(name.as_str()));
        sent.retain(|name, _| names.contains_key(name.as_str()));
        changed = false;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = alerting.wake_alertmanager.notified() => changed = true,
            _ = super::stopped(&mut stop) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: i64 = 1_800_000_000_000;

    /// An `am` channel re-sending every minute (so valid for 4 min), with
    /// `extra` rules text after it.
    fn channel(min_severity: &str, extra: &str) -> (Target, NotifyConfig) {
        let notify = headroom_rules::config::RulesConfig::parse(
            &format!(
                "[[notify.alertmanager]]\nname = \"am\"\nurls = [\"http://am:9093\"]\n\
                 min_severity = \"{min_severity}\"\n{extra}"
            ),
            std::path::Path::new("rules.toml"),
        )
        .unwrap()
        .notify;
        (targets(&notify).remove(0), notify)
    }

    fn alert(rule: &str, severity: &str, state: &str, resolved_at_ms: Option<i64>) -> AlertView {
        AlertView {
            id: 1,
            fingerprint: "f".into(),
            rule: rule.into(),
            severity: severity.into(),
            state: state.into(),
            labels: json!({"node": "gpu-node-02", "gpu": "2", "device_uuid": "GPU-abc",
                           "job": "555", "pod": "", "mig-profile": "1g.10gb"}),
            summary: "GPU 2 on gpu-node-02 is at 93 % of its memory".into(),
            details: json!({"used_fraction": 0.93}),
            started_at_ms: NOW - 120_000,
            fired_at_ms: Some(NOW - 60_000),
            resolved_at_ms,
            updated_at_ms: resolved_at_ms.unwrap_or(NOW - 60_000),
            acknowledged_by: None,
            acknowledged_at_ms: None,
            remedy: "cut the batch size".into(),
        }
    }

    #[test]
    fn a_firing_alert_carries_identifying_labels_and_stays_valid_for_the_given_span() {
        let (target, routing) = channel("info", "");
        let body = payload(
            &[alert("watermark", "critical", "firing", None)],
            &[],
            &target,
            &routing,
            NOW,
            Some("https://headroom.example/"),
        );
        let (fingerprint, a) = &body[0];
        assert_eq!(fingerprint, "f");
        assert_eq!(a["labels"]["alertname"], "watermark");
        assert_eq!(a["labels"]["rule"], "watermark");
        assert_eq!(a["labels"]["severity"], "critical");
        assert_eq!(a["labels"]["node"], "gpu-node-02");
        assert_eq!(a["labels"]["device_uuid"], "GPU-abc");
        assert_eq!(a["labels"]["slurm_job"], "555");
        assert_eq!(a["labels"]["mig_profile"], "1g.10gb");
        assert!(
            a["labels"].get("job").is_none(),
            "job is Prometheus' scrape job"
        );
        assert!(
            a["labels"].get("pod").is_none(),
            "empty values are no labels"
        );
        assert_eq!(a["annotations"]["remedy"], "cut the batch size");
        assert_eq!(a["startsAt"], render::rfc3339(NOW - 60_000).unwrap());
        assert_eq!(a["endsAt"], render::rfc3339(NOW + 240_000).unwrap());
        let link = a["generatorURL"].as_str().unwrap();
        assert!(
            link.starts_with("https://headroom.example/?gpu=GPU-abc"),
            "{link}"
        );
        assert_eq!(a["annotations"]["dashboard"], link);
    }

    #[test]
    fn a_resolved_alert_is_sent_with_its_end_until_it_is_old() {
        let fresh = alert("leak", "warning", "resolved", Some(NOW - 60_000));
        let old = alert("leak", "warning", "resolved", Some(NOW - 16 * 60_000));
        let (target, routing) = channel("info", "");
        let body = payload(&[fresh, old], &[], &target, &routing, NOW, None);
        assert_eq!(body.len(), 1);
        assert_eq!(body[0].1["endsAt"], render::rfc3339(NOW - 60_000).unwrap());
        assert!(body[0].1.get("generatorURL").is_none());
    }

    #[test]
    fn silenced_and_too_mild_alerts_stay_out() {
        let silence = SilenceView {
            id: 1,
            matchers: json!({"node": "gpu-node-02", "rule": "leak"}),
            comment: String::new(),
            created_by: String::new(),
            starts_at_ms: NOW - 1,
            ends_at_ms: NOW + 1,
        };
        let alerts = [
            alert("leak", "warning", "firing", None),
            alert("watermark", "warning", "firing", None),
            alert("watermark", "info", "firing", None),
        ];
        let (target, routing) = channel("warning", "");
        let body = payload(&alerts, &[silence], &target, &routing, NOW, None);
        let rules: Vec<(&str, &str)> = body
            .iter()
            .map(|(_, a)| {
                (
                    a["labels"]["rule"].as_str().unwrap(),
                    a["labels"]["severity"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(rules, vec![("watermark", "warning")]);
    }

    #[test]
    fn an_escalation_ends_the_old_label_set_at_once_and_keeps_ending_it() {
        let mut sent = Sent::default();
        let (target, routing) = channel("info", "");
        let warning = payload(
            &[alert("watermark", "warning", "firing", None)],
            &[],
            &target,
            &routing,
            NOW,
            None,
        );
        assert_eq!(sent.body(warning.clone(), NOW).len(), 1);
        assert_eq!(
            sent.body(warning, NOW + 1_000).len(),
            1,
            "no change, nothing ended"
        );
        let critical = payload(
            &[alert("watermark", "critical", "firing", None)],
            &[],
            &target,
            &routing,
            NOW + 2_000,
            None,
        );
        let body = sent.body(critical.clone(), NOW + 2_000);
        let severities: Vec<(&str, &str)> = body
            .iter()
            .map(|a| {
                (
                    a["labels"]["severity"].as_str().unwrap(),
                    a["endsAt"].as_str().unwrap(),
                )
            })
            .collect();
        let ended = render::rfc3339(NOW + 2_000).unwrap();
        let valid = render::rfc3339(NOW + 242_000).unwrap();
        assert_eq!(
            severities,
            vec![("critical", valid.as_str()), ("warning", ended.as_str())]
        );
        // A later push still carries the end, in case the first one failed,
        // until a resolved alert would no longer be sent.
        assert_eq!(sent.body(critical.clone(), NOW + 60_000).len(), 2);
        assert_eq!(sent.body(critical, NOW + 2_000 + 16 * 60_000).len(), 1);
    }

    #[test]
    fn only_alerts_the_route_table_sends_here_are_pushed() {
        let (target, routing) = channel(
            "info",
            "[[notify.webhook]]\nname = \"ops\"\nurl = \"https://ops\"\nsecret = \"s\"\n\
             [notify.owners]\nnodes = { gpu-node-02 = \"vision\" }\n\
             [[notify.route]]\nmatchers = { team = \"vision\", rule = \"leak\" }\nchannels = [\"am\"]\n\
             [[notify.route]]\nchannels = [\"ops\"]\n",
        );
        let alerts = [
            alert("leak", "warning", "firing", None),
            alert("watermark", "warning", "firing", None),
        ];
        let body = payload(&alerts, &[], &target, &routing, NOW, None);
        let rules: Vec<&str> = body
            .iter()
            .map(|(_, a)| a["labels"]["rule"].as_str().unwrap())
            .collect();
        assert_eq!(
            rules,
            vec!["leak"],
            "the watermark alert is routed to ops only"
        );
    }

    #[test]
    fn an_alert_that_fired_again_is_sent_once_as_firing() {
        let mut old = alert("watermark", "warning", "resolved", Some(NOW - 60_000));
        old.id = 1;
        let mut again = alert("watermark", "warning", "firing", None);
        again.id = 2;
        let rows = newest_per_fingerprint(vec![again.clone(), old.clone()]);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].state, "firing");
        // A label set ended by an escalation that comes back is not also
        // sent as ended.
        let (target, routing) = channel("info", "");
        let mut sent = Sent::default();
        let warning = payload(&[again.clone()], &[], &target, &routing, NOW, None);
        sent.body(warning.clone(), NOW);
        let mut critical = again.clone();
        critical.severity = "critical".into();
        let critical = payload(&[critical], &[], &target, &routing, NOW + 1_000, None);
        assert_eq!(sent.body(critical, NOW + 1_000).len(), 2);
        let back = payload(&[again], &[], &target, &routing, NOW + 2_000, None);
        let body = sent.body(back, NOW + 2_000);
        let warnings: Vec<&Value> = body
            .iter()
            .filter(|a| a["labels"]["severity"] == "warning")
            .collect();
        assert_eq!(warnings.len(), 1, "{body:?}");
        assert_eq!(
            warnings[0]["endsAt"],
            render::rfc3339(NOW + 2_000 + 240_000).unwrap()
        );
    }

    #[test]
    fn label_names_become_valid_prometheus_names() {
        assert_eq!(label_name("device_uuid"), "device_uuid");
        assert_eq!(label_name("mig-profile"), "mig_profile");
        assert_eq!(label_name("9lives"), "_9lives");
        assert_eq!(label_name(""), "_");
        assert_eq!(label_name("job"), "slurm_job");
        assert_eq!(label_name("account"), "slurm_account");
    }
}
