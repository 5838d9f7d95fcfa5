//! `backtest`: replays a recorded memory trace through the rules and reports
//! the alerts they would have raised, to tune rules before deploying them.
//!
//! Trace format (CSV, header required, rows in time order):
//! ```text
//! timestamp_ms,node,gpu,pid,used_bytes,total_bytes
//! 1700000000000,gpu-node-01,0,,42949672960,85899345920      <- whole GPU (pid empty)
//! 1700000000000,gpu-node-01,0,4242,40802189312,85899345920  <- one process on it
//! ```
//! `gpu` is the GPU's index (or any stable name); `total_bytes` is the GPU's
//! total memory on every row.

use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;

use serde::Serialize;

use crate::alert::AlertChange;
use crate::config::RulesConfig;
use crate::engine::Engine;
use crate::lifecycle::Transition;
use crate::observation::{DeviceObservation, ProcessObservation};

/// 2100-01-01: later timestamps are typos (seconds × 1e6, or nanoseconds).
const MAX_TIMESTAMP_MS: i64 = 4_102_444_800_000;

pub const HEADER: &str = "timestamp_ms,node,gpu,pid,used_bytes,total_bytes";

/// One alert as the backtest saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BacktestAlert {
    pub rule: String,
    pub severity: String,
    pub labels: BTreeMap<String, String>,
    pub fired_at_ms: i64,
    pub resolved_at_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_oom_at_ms: Option<i64>,
    pub summary: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TraceError {
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for TraceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// One line of a trace.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    pub(crate) ts: i64,
    pub(crate) node: String,
    pub(crate) gpu: String,
    pub(crate) pid: Option<u32>,
    pub(crate) used: u64,
    pub(crate) total: u64,
}

pub(crate) fn parse_row(line: &str) -> Result<Row, String> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    if fields.len() != 6 {
        return Err(format!(
            "expected 6 fields ({HEADER}), found {}",
            fields.len()
        ));
    }
    let number = |name: &str, v: &str| -> Result<u64, String> {
        v.parse::<u64>()
            .map_err(|_| format!("{name} {v:?} is not a non-negative integer"))
    };
    let ts = fields[0]
        .parse::<i64>()
        .ok()
        .filter(|ts| (0..=MAX_TIMESTAMP_MS).contains(ts))
        .ok_or_else(|| {
            format!(
                "timestamp_ms {:?} is not epoch milliseconds between 1970 and 2100",
                fields[0]
            )
        })?;
    if fields[1].is_empty() || fields[2].is_empty() {
        return Err("node and gpu must not be empty".into());
    }
    let pid = match fields[3] {
        "" => None,
        p => Some(
            p.parse::<u32>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("pid {p:?} is not a positive integer"))?,
        ),
    };
    let used = number("used_bytes", fields[4])?;
    let total = number("total_bytes", fields[5])?;
    if total == 0 {
        return Err("total_bytes is 0".into());
    }
    if pid.is_none() && used > total {
        return Err(format!("used_bytes {used} exceeds total_bytes {total}"));
    }
    Ok(Row {
        ts,
        node: fields[1].to_owned(),
        gpu: fields[2].to_owned(),
        pid,
        used,
        total,
    })
}

#[derive(Debug, Default)]
struct Collected {
    open: HashMap<String, BacktestAlert>,
    done: Vec<BacktestAlert>,
}

impl Collected {
    fn take(&mut self, changes: Vec<AlertChange>) {
        for c in changes {
            match c.transition {
                Transition::Firing { .. } => {
                    let predicted = c
                        .details
                        .get("predicted_oom_at_ms")
                        .and_then(|v| v.as_i64());
                    let entry =
                        self.open
                            .entry(c.fingerprint.clone())
                            .or_insert_with(|| BacktestAlert {
                                rule: c.rule.to_owned(),
                                severity: c.severity.as_str().to_owned(),
                                labels: c.labels.clone(),
                                fired_at_ms: c.at_ms,
                                resolved_at_ms: None,
                                predicted_oom_at_ms: predicted,
                                summary: c.summary.clone(),
                            });
                    entry.severity = c.severity.as_str().to_owned();
                }
                Transition::Resolved => {
                    if let Some(mut alert) = self.open.remove(&c.fingerprint) {
                        alert.resolved_at_ms = Some(c.at_ms);
                        self.done.push(alert);
                    }
                }
                Transition::Pending { .. } | Transition::Withdrawn => {}
            }
        }
    }
}

/// Runs the trace; returns the alerts (fired order) and the bad lines.
pub fn run(rules: RulesConfig, trace: impl BufRead) -> (Vec<BacktestAlert>, Vec<TraceError>) {
    let mut engine = Engine::new(rules);
    let mut collected = Collected::default();
    let mut errors = Vec::new();
    let mut first_seen: HashMap<(String, String, u32), i64> = HashMap::new();
    let mut last_tick = i64::MIN;
    let mut last_ts = i64::MIN;
    for (index, line) in trace.lines().enumerate() {
        let number = index + 1;
        let line = match line {
            Ok(line) => line,
            Err(e) => {
                errors.push(TraceError {
                    line: number,
                    message: format!("unreadable: {e}"),
                });
                continue;
            }
        };
        if number == 1 {
            if line.trim() != HEADER {
                errors.push(TraceError {
                    line: 1,
                    message: format!("header must be {HEADER:?}"),
                });
            }
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let row = match parse_row(&line) {
            Ok(row) => row,
            Err(message) => {
                errors.push(TraceError {
                    line: number,
                    message,
                });
                continue;
            }
        };
        if row.ts < last_ts {
            errors.push(TraceError {
                line: number,
                message: format!(
                    "timestamp {} goes back in time (previous {last_ts})",
                    row.ts
                ),
            });
            continue;
        }
        last_ts = row.ts;
        if row.ts.saturating_sub(last_tick) >= 1000 {
            collected.take(engine.tick(row.ts));
            last_tick = row.ts;
        }
        let gpu_index = row.gpu.parse::<u32>().unwrap_or(0);
        let device = format!("{}/{}", row.node, row.gpu);
        let changes = match row.pid {
            None => engine.observe_device(&DeviceObservation {
                node: &row.node,
                device_uuid: &device,
                gpu_index,
                mig_profile: None,
                timestamp_ms: row.ts,
                used_last: row.used,
                used_max: row.used,
                reserved: 0,
                total: row.total,
                attributed: None,
                largest_process: None,
            }),
            Some(pid) => {
                let start = *first_seen
                    .entry((row.node.clone(), row.gpu.clone(), pid))
                    .or_insert(row.ts);
                engine.observe_process(&ProcessObservation {
                    node: &row.node,
                    device_uuid: &device,
                    gpu_index,
                    pid,
                    start_time_ms: start,
                    name: "",
                    user: "",
                    slurm_job_id: "",
                    slurm_account: "",
                    pod_uid: "",
                    pod_namespace: "",
                    pod_labels: &[],
                    container_id: "",
                    timestamp_ms: row.ts,
                    used_last: row.used,
                    used_max: row.used,
                    allocator: None,
                })
            }
        };
        collected.take(changes);
    }
    let mut alerts = collected.done;
    alerts.extend(collected.open.into_values());
    alerts.sort_by(|a, b| (a.fired_at_ms, &a.rule).cmp(&(b.fired_at_ms, &b.rule)));
    (alerts, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn trace(rows: impl Iterator<Item = String>) -> String {
        let mut text = format!("{HEADER}\n");
        for r in rows {
            text.push_str(&r);
            text.push('\n');
        }
        text
    }

    #[test]
    fn a_gpu_crossing_the_watermark_fires_once_and_resolves() {
        let rows = (0..300).map(|s| {
            let used = if (100..200).contains(&s) {
                78 * GIB
            } else {
                40 * GIB
            };
            format!("{},n1,3,,{used},{}", 1_000_000 + s * 1000, 80 * GIB)
        });
        let (alerts, errors) = run(RulesConfig::default(), trace(rows).as_bytes());
        assert!(errors.is_empty(), "{errors:?}");
        let watermark: Vec<_> = alerts.iter().filter(|a| a.rule == "watermark").collect();
        assert_eq!(watermark.len(), 1, "{alerts:?}");
        assert_eq!(watermark[0].fired_at_ms, 1_100_000);
        assert_eq!(watermark[0].resolved_at_ms, Some(1_200_000));
        assert_eq!(watermark[0].severity, "critical");
        assert_eq!(watermark[0].labels["gpu"], "3");
    }

    #[test]
    fn bad_lines_are_reported_by_number_and_skipped() {
        let text = format!(
            "{HEADER}\n1000,n1,0,,5,10\n2000,n1,0,,lots,10\n3000,n1,0\n4000,n1,0,-3,5,10\n500,n1,0,,5,10\n5000,n1,0,,11,10\n1700000000000000000,n1,0,,5,10\n"
        );
        let (_, errors) = run(RulesConfig::default(), text.as_bytes());
        let lines: Vec<usize> = errors.iter().map(|e| e.line).collect();
        assert_eq!(lines, vec![3, 4, 5, 6, 7, 8], "{errors:?}");
        assert!(errors[5].message.contains("between 1970 and 2100"));
        assert!(errors[0].to_string().contains("used_bytes \"lots\""));
        assert!(errors[3].message.contains("back in time"));
    }

    #[test]
    fn wrong_header_is_reported() {
        let (_, errors) = run(RulesConfig::default(), "ts,node\n".as_bytes());
        assert_eq!(errors[0].line, 1);
    }
}
