//! `headroom-collector route`: which channels an alert (or, with
//! `rule=job_report`, a job's memory report) with given labels would reach
//! under a rules file, and why, without sending anything.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use headroom_rules::config::{RulesConfig, Severity};
use headroom_rules::routing::{JOB_REPORT_RULE, Via};

/// One line per channel: whether it sends, and by which route.
pub fn explain(config: &RulesConfig, pairs: &[String]) -> anyhow::Result<String> {
    let mut labels = BTreeMap::new();
    for pair in pairs {
        let (key, value) = pair
            .split_once('=')
            .with_context(|| format!("{pair:?} is not label=value"))?;
        labels.insert(key.to_owned(), value.to_owned());
    }
    if labels.get("rule").map(String::as_str) == Some(JOB_REPORT_RULE) {
        return Ok(explain_job_report(config, &labels));
    }
    let Some(severity) = labels.get("severity").cloned() else {
        bail!("name the alert's severity: severity=critical, warning or info");
    };
    let level = match severity.as_str() {
        "critical" => Severity::Critical,
        "warning" => Severity::Warning,
        "info" => Severity::Info,
        other => bail!("severity={other} is not critical, warning or info"),
    };
    let rule = labels.get("rule").cloned().unwrap_or_default();
    let notify = &config.notify;
    let labels = notify.routing_labels(&labels, &rule, &severity);
    let routed = notify.route(&labels);
    let shown: Vec<String> = labels
        .iter()
        .filter(|(k, v)| !(k.as_str() == "rule" && v.is_empty()))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let mut out = format!("labels: {}\n", shown.join(" "));
    let channels = notify.channels();
    if channels.is_empty() {
        out.push_str("no notification channels are configured\n");
    }
    let width = channels.iter().map(|(n, _, _)| n.len()).max().unwrap_or(0);
    for (name, kind, min_severity) in channels {
        let via = routed.iter().find(|(c, _)| *c == name).map(|(_, via)| *via);
        let why = match via {
            None => "no: no route sends it here".to_owned(),
            Some(via) => {
                let by = match via {
                    Via::Route(i) => format!("route {} ([[notify.route]] #{})", i + 1, i + 1),
                    Via::Default => "default_channels".to_owned(),
                    Via::Everyone => "no route took it: every channel".to_owned(),
                };
                if level >= min_severity {
                    format!("sends, by {by}")
                } else {
                    format!(
                        "no: routed by {by}, but below its min_severity {}",
                        min_severity.as_str()
                    )
                }
            }
        };
        out.push_str(&format!("{name:width$}  {kind:12}  {why}\n"));
    }
    Ok(out)
}

/// Job reports take only the routes that name `rule = "job_report"`, and
/// only webhooks and Slack; `min_severity` does not apply to them.
fn explain_job_report(config: &RulesConfig, labels: &BTreeMap<String, String>) -> String {
    let notify = &config.notify;
    let mut owner = labels.clone();
    owner.remove("rule");
    owner.remove("severity");
    let labels = notify.job_report_labels(&owner);
    let routed = notify.job_report_channels(&labels);
    let shown: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut out = format!("labels: {}\n", shown.join(" "));
    let channels = notify.channels();
    let width = channels.iter().map(|(n, _, _)| n.len()).max().unwrap_or(0);
    for (name, kind, _) in channels {
        let why = if !matches!(kind, "webhook" | "slack") {
            "no: job reports go to webhooks and Slack only"
        } else if routed.contains(&name) {
            "sends the report, by a route naming rule = \"job_report\""
        } else {
            "no: no route naming rule = \"job_report\" sends it here"
        };
        out.push_str(&format!("{name:width$}  {kind:12}  {why}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RulesConfig {
        RulesConfig::parse(
            "[[notify.webhook]]\nname = \"ops\"\nurl = \"https://ops\"\nsecret = \"s\"\n\
             [[notify.pagerduty]]\nname = \"vision-pager\"\nrouting_key = \"k\"\nmin_severity = \"critical\"\n\
             [notify.owners]\nusers = { carol = \"vision\" }\n\
             [[notify.route]]\nmatchers = { team = \"vision\" }\nchannels = [\"vision-pager\"]\n",
            std::path::Path::new("rules.toml"),
        )
        .unwrap()
    }

    fn ask(pairs: &[&str]) -> anyhow::Result<String> {
        let pairs: Vec<String> = pairs.iter().map(|p| (*p).to_owned()).collect();
        explain(&config(), &pairs)
    }

    #[test]
    fn says_which_channel_sends_and_by_which_route() {
        let out = ask(&["user=carol", "severity=critical", "rule=leak"]).unwrap();
        assert!(out.contains("team=vision"), "{out}");
        assert!(
            out.contains("vision-pager  pagerduty     sends, by route 1"),
            "{out}"
        );
        assert!(
            out.contains("ops           webhook       no: no route sends it here"),
            "{out}"
        );
        let out = ask(&["user=carol", "severity=warning"]).unwrap();
        assert!(out.contains("below its min_severity critical"), "{out}");
        let out = ask(&["user=dave", "severity=warning"]).unwrap();
        assert!(
            out.contains("ops           webhook       sends, by no route took it"),
            "{out}"
        );
    }

    #[test]
    fn a_job_report_goes_only_where_a_report_route_sends_it() {
        let config = RulesConfig::parse(
            "[[notify.webhook]]\nname = \"ops\"\nurl = \"https://ops\"\nsecret = \"s\"\n\
             [[notify.slack]]\nname = \"vision-slack\"\nwebhook_url = \"https://slack\"\nmin_severity = \"critical\"\n\
             [[notify.pagerduty]]\nname = \"vision-pager\"\nrouting_key = \"k\"\n\
             [notify.owners]\nusers = { carol = \"vision\" }\n\
             [[notify.route]]\nmatchers = { rule = \"job_report\", team = \"vision\" }\nchannels = [\"vision-slack\", \"vision-pager\"]\n",
            std::path::Path::new("rules.toml"),
        )
        .unwrap();
        let pairs = [
            "rule=job_report".to_owned(),
            "user=carol".to_owned(),
            "job=77".to_owned(),
        ];
        let out = explain(&config, &pairs).unwrap();
        assert!(
            out.contains("team=vision") && out.contains("severity=info"),
            "{out}"
        );
        assert!(
            out.contains("vision-slack  slack         sends the report"),
            "{out}"
        );
        assert!(
            out.contains("vision-pager  pagerduty     no: job reports go to webhooks"),
            "{out}"
        );
        assert!(
            out.contains("ops           webhook       no: no route naming"),
            "{out}"
        );
    }

    #[test]
    fn bad_questions_are_named() {
        let e = ask(&["user=carol"]).unwrap_err().to_string();
        assert!(e.contains("severity="), "{e}");
        let e = ask(&["severity=urgent"]).unwrap_err().to_string();
        assert!(e.contains("severity=urgent"), "{e}");
        let e = ask(&["carol", "severity=info"]).unwrap_err().to_string();
        assert!(e.contains("\"carol\" is not label=value"), "{e}");
    }
}
