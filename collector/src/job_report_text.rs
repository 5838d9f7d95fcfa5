//! A job's memory report as text for its owner: what
//! `headroom-collector job-report ID` prints and what a Slack channel on
//! the owner's route is sent.

use std::fmt::Write as _;

use headroom_common::ApproxBytes;
use serde_json::Value;

use crate::alerts::render::rfc3339;

fn at(ms: &Value) -> String {
    ms.as_i64()
        .and_then(rfc3339)
        .unwrap_or_else(|| "?".to_owned())
}

fn bytes(v: &Value) -> String {
    ApproxBytes(v.as_u64().unwrap_or(0)).to_string()
}

fn list(v: &Value) -> String {
    let items: Vec<&str> = v
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if items.is_empty() {
        "—".to_owned()
    } else {
        items.join(", ")
    }
}

pub fn render(report: &Value) -> String {
    let mut out = String::new();
    let kind = match report["kind"].as_str() {
        Some("slurm") => "Slurm job",
        Some("pod") => "Pod",
        Some("process_group") => "Process group",
        _ => "Job",
    };
    let _ = writeln!(
        out,
        "{kind} {}: users {}; nodes {}",
        report["job_id"].as_str().unwrap_or("?"),
        list(&report["users"]),
        list(&report["nodes"])
    );
    let _ = writeln!(
        out,
        "seen from {} to {}{}",
        at(&report["observed_from_ms"]),
        at(&report["last_seen_ms"]),
        if report["ended_at_ms"].is_null() {
            " (still running on a node)"
        } else {
            ""
        }
    );
    for gpu in report["gpus"].as_array().into_iter().flatten() {
        let mig = gpu["mig_profile"]
            .as_str()
            .map(|p| format!(" MIG {p}"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{} GPU {}{mig}: peak {} of {} at {}, {} left",
            gpu["node"].as_str().unwrap_or("?"),
            gpu["gpu"],
            bytes(&gpu["peak_bytes"]),
            bytes(&gpu["total_bytes"]),
            at(&gpu["peak_at_ms"]),
            bytes(&gpu["headroom_bytes"]),
        );
        let c = &gpu["composition"];
        if c.is_object() {
            let parts: Vec<String> = [
                ("weights_bytes", "weights"),
                ("gradients_bytes", "gradients"),
                ("optimizer_state_bytes", "optimizer state"),
                ("activations_bytes", "activations"),
                ("cache_bytes", "allocator cache"),
                ("outside_allocator_bytes", "outside the allocator"),
            ]
            .iter()
            .filter(|(k, _)| c[*k].as_u64().is_some_and(|b| b > 0))
            .map(|(k, name)| format!("{name} {}", bytes(&c[*k])))
            .collect();
            let _ = writeln!(out, "  at the peak: {}", parts.join(", "));
        }
        let _ = writeln!(
            out,
            "  suggestion: {}",
            gpu["suggestion"].as_str().unwrap_or("—")
        );
    }
    let alerts = report["alerts"].as_array().cloned().unwrap_or_default();
    if alerts.is_empty() {
        out.push_str("alerts: none\n");
    } else {
        out.push_str("alerts:\n");
        for a in &alerts {
            let _ = writeln!(
                out,
                "  {} {} {}: {}",
                a["severity"].as_str().unwrap_or("?"),
                a["rule"].as_str().unwrap_or("?"),
                at(&a["fired_at_ms"]),
                a["summary"].as_str().unwrap_or("")
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn says_the_peak_the_suggestion_and_the_alerts() {
        let text = render(&json!({
            "kind": "slurm", "job_id": "4242", "users": ["carol"], "nodes": ["gpu-a01"],
            "observed_from_ms": 1_800_000_000_000i64, "last_seen_ms": 1_800_000_600_000i64,
            "ended_at_ms": 1_800_000_600_000i64,
            "gpus": [{"node": "gpu-a01", "gpu": 0, "mig_profile": null,
                      "peak_bytes": 85_362_475_008u64, "total_bytes": 85_899_345_920u64,
                      "headroom_bytes": 536_870_912u64, "peak_at_ms": 1_800_000_300_000i64,
                      "composition": {"weights_bytes": 1_073_741_824u64, "activations_bytes": 0},
                      "suggestion": "peaked at 79.5 GiB of 80 GiB, within 5 % of out of memory: …"}],
            "alerts": [{"severity": "critical", "rule": "watermark",
                        "fired_at_ms": 1_800_000_290_000i64, "summary": "GPU 0 at 96 %"}],
        }));
        assert!(
            text.starts_with("Slurm job 4242: users carol; nodes gpu-a01\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "gpu-a01 GPU 0: peak 79.5 GiB of 80 GiB at 2027-01-15T08:05:00Z, 512 MiB left"
            ),
            "{text}"
        );
        assert!(text.contains("  at the peak: weights 1 GiB\n"), "{text}");
        assert!(text.contains("  suggestion: peaked at 79.5 GiB"), "{text}");
        assert!(
            text.contains("  critical watermark 2027-01-15T08:04:50Z: GPU 0 at 96 %"),
            "{text}"
        );
    }
}
