//! How alert messages name a series and write a quantity, so that every
//! rule's summary reads alike ("GPU 3 on node-7", "pid 42 (python) of
//! alice", "12 min") and a change of wording happens in one place.

use std::collections::BTreeMap;

fn label<'a>(labels: &'a BTreeMap<String, String>, key: &str) -> &'a str {
    labels.get(key).map_or("", String::as_str)
}

/// A GPU or MIG instance, from its series labels.
pub(crate) fn device_name(labels: &BTreeMap<String, String>) -> String {
    let node = label(labels, "node");
    let gpu = label(labels, "gpu");
    match labels.get("mig_profile") {
        Some(profile) => format!("GPU {gpu} (MIG {profile}) on {node}"),
        None => format!("GPU {gpu} on {node}"),
    }
}

/// A process with whatever owner the agent could attribute it to.
pub(crate) fn process_name(labels: &BTreeMap<String, String>) -> String {
    let mut who = format!(
        "pid {} ({})",
        label(labels, "pid"),
        label(labels, "process")
    );
    if let Some(user) = labels.get("user") {
        who.push_str(&format!(" of {user}"));
    }
    if let Some(job) = labels.get("job") {
        who.push_str(&format!(", Slurm job {job}"));
        if let Some(account) = labels.get("account") {
            who.push_str(&format!(" ({account})"));
        }
    }
    if let Some(pod) = labels.get("pod") {
        who.push_str(&format!(", pod {pod}"));
        if let Some(namespace) = labels.get("namespace") {
            who.push_str(&format!(" in {namespace}"));
        }
    }
    who
}

/// Where an event happened: its GPU when the agent named one, else its node.
pub(crate) fn event_place(labels: &BTreeMap<String, String>, node: &str) -> String {
    if labels.contains_key("gpu") {
        device_name(labels)
    } else {
        format!("node {node}")
    }
}

/// The agent's own words about an event, bounded: a driver message can run
/// to kilobytes and would swamp a notification.
pub(crate) fn event_detail(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(" ({})", detail.chars().take(300).collect::<String>())
    }
}

/// A duration in the unit a person would say it in.
pub(crate) fn minutes(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    if s < 120 {
        format!("{s} s")
    } else if s < 7200 {
        format!("{} min", s / 60)
    } else {
        format!("{:.1} h", s as f64 / 3600.0)
    }
}

/// `part` as a percentage of `total` to one decimal; 0 when the total is
/// unknown.
pub(crate) fn percent(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        (part as f64 * 1000.0 / total as f64).round() / 10.0
    }
}
