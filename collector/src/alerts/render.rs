//! What a notification says, per channel. Rendered once when the alert
//! changes and stored in the outbox, so every retry sends the same body.
//!
//! Generic webhook body (schema version 1):
//! ```json
//! { "version": 1, "status": "firing" | "resolved", "idempotency_key": "…",
//!   "alert": { "fingerprint": "…", "rule": "watermark", "severity": "critical",
//!              "summary": "…", "labels": { "node": "…", "gpu": "3", … },
//!              "details": { … rule-specific values … }, "at_ms": 1700000000000,
//!              "remedy": "what the job's owner can do" | null },
//!   "dashboard_url": "https://…" | null }
//! ```

use serde_json::{Value, json};

use headroom_rules::alert::AlertChange;

/// `firing` or `resolved`, as the receiver sees it.
pub fn status(change: &AlertChange) -> &'static str {
    use headroom_rules::lifecycle::Transition;
    match change.transition {
        Transition::Resolved | Transition::Withdrawn => "resolved",
        Transition::Pending { .. } | Transition::Firing { .. } => "firing",
    }
}

pub fn dashboard_link(base: Option<&str>, change: &AlertChange) -> Option<String> {
    dashboard_link_at(
        base,
        change.labels.get("device_uuid").map(String::as_str),
        change.at_ms,
    )
}

/// The dashboard around `at_ms`: the GPU's page from an hour before to ten
/// minutes after, or the fleet when the alert names no GPU.
pub fn dashboard_link_at(
    base: Option<&str>,
    device_uuid: Option<&str>,
    at_ms: i64,
) -> Option<String> {
    let base = base?.trim_end_matches('/');
    Some(match device_uuid {
        Some(uuid) => format!(
            "{base}/?gpu={uuid}&from={}&to={}",
            at_ms - 3_600_000,
            at_ms + 600_000
        ),
        None => format!("{base}/"),
    })
}

/// `2026-12-07T10:35:16.123Z`; none for a time no calendar can write.
pub fn rfc3339(ms: i64) -> Option<String> {
    let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok()?;
    at.format(&time::format_description::well_known::Rfc3339)
        .ok()
}

pub fn webhook(change: &AlertChange, key: &str, dashboard: Option<&str>) -> String {
    json!({
        "version": 1,
        "status": status(change),
        "idempotency_key": key,
        "alert": {
            "fingerprint": change.fingerprint,
            "rule": change.rule,
            "severity": change.severity.as_str(),
            "summary": change.summary,
            "labels": change.labels,
            "details": change.details,
            "at_ms": change.at_ms,
            "remedy": (!change.remedy.is_empty()).then_some(&change.remedy),
        },
        "dashboard_url": dashboard_link(dashboard, change),
    })
    .to_string()
}

/// PagerDuty Events API v2, without the routing key (a secret the sender
/// adds, so it is never stored in the outbox). The fingerprint is the dedup
/// key: an escalation updates the open incident, a resolution closes it.
pub fn pagerduty(change: &AlertChange, dashboard: Option<&str>) -> String {
    if status(change) == "resolved" {
        return json!({ "event_action": "resolve", "dedup_key": change.fingerprint }).to_string();
    }
    let label = |k: &str| change.labels.get(k).map(String::as_str);
    let mut payload = json!({
        // PagerDuty refuses a summary over 1,024 characters.
        "summary": change.summary.chars().take(1024).collect::<String>(),
        "source": label("node").unwrap_or("headroom"),
        // Events v2 knows critical, error, warning and info.
        "severity": change.severity.as_str(),
        "class": change.rule,
        "custom_details": {
            "labels": change.labels,
            "details": change.details,
            "remedy": (!change.remedy.is_empty()).then_some(&change.remedy),
        },
    });
    if let Some(gpu) = label("gpu") {
        payload["component"] = format!("GPU {gpu}").into();
    }
    if let Some(group) = label("job").or(label("pod")).or(label("user")) {
        payload["group"] = group.into();
    }
    if let Some(at) = rfc3339(change.at_ms) {
        payload["timestamp"] = at.into();
    }
    let mut body = json!({
        "event_action": "trigger",
        "dedup_key": change.fingerprint,
        "payload": payload,
        "client": "Headroom",
    });
    if let Some(link) = dashboard_link(dashboard, change) {
        body["links"] = json!([{ "href": link, "text": "Open in Headroom" }]);
    }
    if let Some(base) = dashboard {
        body["client_url"] = base.into();
    }
    body.to_string()
}

/// Slack Block Kit: what, where, who, how much, and a link.
pub fn slack(change: &AlertChange, dashboard: Option<&str>) -> String {
    let resolved = status(change) == "resolved";
    let icon = match (resolved, change.severity.as_str()) {
        (true, _) => ":white_check_mark:",
        (false, "critical") => ":red_circle:",
        _ => ":large_orange_circle:",
    };
    let title = format!(
        "{icon} {} {} — {}",
        if resolved { "RESOLVED" } else { "FIRING" },
        change.severity.as_str(),
        change.rule
    );
    let label = |k: &str| change.labels.get(k).map(String::as_str).unwrap_or("—");
    let mut fields = vec![
        json!({"type": "mrkdwn", "text": format!("*Node*\n{}", label("node"))}),
        json!({"type": "mrkdwn", "text": format!("*GPU*\n{}{}", label("gpu"),
            change.labels.get("mig_profile").map(|p| format!(" (MIG {p})")).unwrap_or_default())}),
    ];
    for (key, title) in [
        ("user", "User"),
        ("job", "Slurm job"),
        ("account", "Slurm account"),
        ("pod", "Pod"),
        ("namespace", "Namespace"),
        ("pid", "PID"),
    ] {
        if let Some(v) = change.labels.get(key) {
            fields.push(json!({"type": "mrkdwn", "text": format!("*{title}*\n{v}")}));
        }
    }
    let mut blocks = vec![
        json!({"type": "header", "text": {"type": "plain_text", "text": title}}),
        json!({"type": "section", "text": {"type": "mrkdwn", "text": change.summary}}),
        json!({"type": "section", "fields": fields}),
    ];
    if !resolved && !change.remedy.is_empty() {
        blocks.push(json!({"type": "section", "text": {"type": "mrkdwn",
            "text": format!("*What to try*\n{}", change.remedy)}}));
    }
    if let Some(link) = dashboard_link(dashboard, change) {
        blocks.push(json!({"type": "actions", "elements": [
            {"type": "button", "text": {"type": "plain_text", "text": "Open in Headroom"}, "url": link}
        ]}));
    }
    let value: Value = json!({ "text": format!("{title}: {}", change.summary), "blocks": blocks });
    value.to_string()
}

/// One Slack message for several alerts of one group: their blocks one after
/// another, separated by dividers, under a count.
pub fn merge_slack(payloads: &[&str]) -> String {
    if let [single] = payloads {
        return (*single).to_owned();
    }
    let mut blocks: Vec<Value> = Vec::new();
    let mut texts: Vec<String> = Vec::new();
    for p in payloads {
        let Ok(v) = serde_json::from_str::<Value>(p) else {
            continue;
        };
        if !blocks.is_empty() {
            blocks.push(json!({"type": "divider"}));
        }
        if let Some(b) = v["blocks"].as_array() {
            blocks.extend(b.iter().cloned());
        }
        if let Some(t) = v["text"].as_str() {
            texts.push(t.to_owned());
        }
    }
    json!({ "text": format!("{} alerts: {}", texts.len(), texts.join(" | ")), "blocks": blocks })
        .to_string()
}

/// A job's memory report for a webhook (schema version 1, `kind` tells it
/// from an alert):
/// `{ "version": 1, "kind": "job_report", "idempotency_key": "…",
///    "labels": { "node": …, "job" | "pod": …, "user": …, "team": … },
///    "report": { … as GET /api/v1/jobs/{id}/report … },
///    "dashboard_url": "https://…" | null }`
pub fn job_report_webhook(
    report: &Value,
    labels: &std::collections::BTreeMap<String, String>,
    key: &str,
    dashboard: Option<&str>,
) -> String {
    json!({
        "version": 1,
        "kind": "job_report",
        "idempotency_key": key,
        "labels": labels,
        "report": report,
        "dashboard_url": dashboard.map(|base| format!("{}/", base.trim_end_matches('/'))),
    })
    .to_string()
}

/// A job's memory report for Slack: its first line as the notification
/// text, the whole report (as `headroom-collector job-report` prints it)
/// in a code block.
pub fn job_report_slack(report: &Value) -> String {
    let text = crate::job_report_text::render(report);
    let headline = text.lines().next().unwrap_or("Job memory report");
    // Slack cuts a section's text at 3,000 characters.
    let body: String = text.chars().take(2_900).collect();
    json!({
        "text": format!("Memory report: {headline}"),
        "blocks": [
            {"type": "header", "text": {"type": "plain_text", "text": "Job memory report"}},
            {"type": "section", "text": {"type": "mrkdwn", "text": format!("```{body}```")}},
        ],
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_reports_slack_message_leads_with_the_job_and_holds_the_report() {
        let report = json!({
            "kind": "pod", "job_id": "p-1", "users": ["erin"], "nodes": ["n1"],
            "observed_from_ms": 1_800_000_000_000i64, "last_seen_ms": 1_800_000_060_000i64,
            "ended_at_ms": 1_800_000_060_000i64, "gpus": [], "alerts": [],
        });
        let message: Value = serde_json::from_str(&job_report_slack(&report)).unwrap();
        assert_eq!(
            message["text"],
            "Memory report: Pod p-1: users erin; nodes n1"
        );
        let block = message["blocks"][1]["text"]["text"].as_str().unwrap();
        assert!(
            block.starts_with("```Pod p-1") && block.contains("alerts: none"),
            "{block}"
        );
    }
}
