//! Scores the rules on labelled traces (the built-in [`corpus`] or a
//! directory of them), beside the Prometheus `predict_linear` baseline, so
//! that a change to a detector shows what it costs in false alarms and what
//! it buys in warnings.
//!
//! A labelled directory holds `labels.json`, an object from trace file name
//! (in that directory, in the backtest's CSV format) to its [`Label`].
//!
//! Definitions, per trace:
//! - **Leak** (`leak` alerts): a leak trace alerted at or before its
//!   `leak_found_by_ms` is found (a true positive); alerted only later, it is
//!   late and counts as a miss, with how late; never alerted, missed. A
//!   healthy (`none`) trace with any leak alert is a false alarm. Leak alerts
//!   on `oom` traces count neither way: a ramp to OOM is a leak too.
//!   Precision = found / (found + false alarms); recall = found / leak traces.
//! - **Time to OOM** (`time_to_oom` alerts): on an `oom` trace the lead is
//!   `oom_at_ms` less the first warning fired before it; warnings fired at or
//!   after the OOM do not count. The warning is in time when the lead is at
//!   least `min_lead_ms`, late when shorter, missed when there is none. On a
//!   trace without `oom_at_ms` every warning is false; they are counted one
//!   per alert.
//! - **Baseline**: the `predict_linear` rule ([`crate::predict_linear`]),
//!   scored as time-to-OOM warnings. It has no leak detection: its leak
//!   figures are absent.
//! - Watermark alerts are listed for information and not scored.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Serialize;

use crate::RuleId;
use crate::backtest::{self, parse_row};
use crate::config::RulesConfig;
use crate::corpus::{self, Kind, LABELS_FILE, Label, LabelledTrace};
use crate::predict_linear;

/// Why a labelled directory cannot be scored.
#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    /// `labels.json` missing, unreadable, not an object of file name to
    /// label, or a label whose fields do not fit its kind.
    #[error("{}: {message}", path.display())]
    Labels { path: PathBuf, message: String },
    /// A trace `labels.json` names cannot be read.
    #[error("cannot read trace {}: {source}", path.display())]
    Trace {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Reads `labels.json` in `dir` and the traces it names, and scores them.
/// Bad lines in a trace do not stop the scoring: they are reported on its
/// row of the scorecard.
pub fn score_dir(rules: &RulesConfig, dir: &Path) -> Result<Scorecard, ScoreError> {
    Ok(score_traces(rules, &read_dir(dir)?))
}

/// The traces `labels.json` in `dir` names, with their labels, in name
/// order; a trace's name is its file name less `.csv`.
pub fn read_dir(dir: &Path) -> Result<Vec<LabelledTrace>, ScoreError> {
    let labels_path = dir.join(LABELS_FILE);
    let text = std::fs::read_to_string(&labels_path).map_err(|e| ScoreError::Labels {
        path: labels_path.clone(),
        message: format!("cannot read: {e}"),
    })?;
    let labels = parse_labels(&text, &labels_path)?;
    let mut traces = Vec::with_capacity(labels.len());
    for (file_name, label) in labels {
        let path = dir.join(&file_name);
        let csv = std::fs::read_to_string(&path).map_err(|source| ScoreError::Trace {
            path: path.clone(),
            source,
        })?;
        let name = file_name.strip_suffix(".csv").unwrap_or(&file_name);
        traces.push(LabelledTrace {
            name: name.to_owned(),
            label,
            csv,
        });
    }
    Ok(traces)
}

/// Parses and checks a labels file's text; `path` only names it in errors.
pub fn parse_labels(text: &str, path: &Path) -> Result<BTreeMap<String, Label>, ScoreError> {
    let refuse = |message: String| ScoreError::Labels {
        path: path.to_owned(),
        message,
    };
    let labels: BTreeMap<String, Label> = serde_json::from_str(text).map_err(|e| {
        refuse(format!(
            "not a JSON object of trace file name to label: {e}"
        ))
    })?;
    if labels.is_empty() {
        return Err(refuse("names no trace".into()));
    }
    for (file_name, label) in &labels {
        let plain = Path::new(file_name)
            .file_name()
            .is_some_and(|f| f == file_name.as_str());
        if !plain {
            return Err(refuse(format!(
                "{file_name:?} is not a file name in the labels file's directory"
            )));
        }
        label
            .check()
            .map_err(|e| refuse(format!("label of {file_name:?}: {e}")))?;
    }
    Ok(labels)
}

/// Scores each trace with `rules` and with the baseline, on as many threads
/// as there are cores: the rules' statistics are quadratic in their window
/// and run on every sample, so a few hours of trace take a while.
pub fn score_traces(rules: &RulesConfig, traces: &[LabelledTrace]) -> Scorecard {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(traces.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let mut scored: Vec<(usize, TraceScore)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(trace) = traces.get(index) else {
                            return done;
                        };
                        done.push((index, score_trace(rules, trace)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|worker| {
                worker
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    scored.sort_by_key(|(index, _)| *index);
    let rows: Vec<TraceScore> = scored.into_iter().map(|(_, row)| row).collect();
    Scorecard {
        rules: Totals::of(&rows, |r| &r.rules),
        predict_linear: Totals::of(&rows, |r| &r.predict_linear),
        traces: rows,
    }
}

/// The built-in corpus, scored.
pub fn score_corpus(rules: &RulesConfig) -> Scorecard {
    score_traces(rules, &corpus::corpus())
}

/// Everything the scorecard says.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scorecard {
    pub traces: Vec<TraceScore>,
    pub rules: Totals,
    pub predict_linear: Totals,
}

/// One trace: its label, and what each detector made of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceScore {
    pub name: String,
    pub label: Label,
    /// The trace's first timestamp; the table shows times from it.
    pub start_ms: i64,
    pub rules: Outcome,
    pub predict_linear: Outcome,
    /// When watermark alerts fired: for information, not scored.
    pub watermark_fired_ms: Vec<i64>,
    /// Leak alerts on a leak trace's other processes: false alarms.
    pub wrong_process_leak_alerts: usize,
    /// Lines the backtest skipped, as `line N: what`.
    pub errors: Vec<String>,
}

/// One detector on one trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    /// `None` for a detector without leak detection.
    pub leak: Option<LeakVerdict>,
    pub leak_fired_ms: Vec<i64>,
    pub oom: OomVerdict,
    pub oom_fired_ms: Vec<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum LeakVerdict {
    /// A leak alerted by its deadline.
    Found { at_ms: i64 },
    /// A leak alerted only after its deadline: a miss.
    Late { at_ms: i64, late_by_ms: i64 },
    /// A leak never alerted.
    Missed,
    /// A healthy trace with leak alerts.
    FalseAlarm { alerts: usize, first_at_ms: i64 },
    /// A healthy trace without one.
    Quiet,
    /// An OOM trace: its leak alerts are not scored.
    NotScored,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum OomVerdict {
    /// Warned at least the minimum lead before the OOM.
    InTime { lead_ms: i64 },
    /// Warned before the OOM, but with less than the minimum lead.
    Late { lead_ms: i64 },
    /// No warning before the OOM.
    Missed,
    /// Warnings on a trace that does not run out of memory.
    FalseWarnings { alerts: usize, first_at_ms: i64 },
    /// No warning, and no OOM.
    Quiet,
}

/// One detector over all the traces.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Totals {
    /// `None` for a detector without leak detection.
    pub leak: Option<LeakTotals>,
    pub oom: OomTotals,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeakTotals {
    pub leak_traces: usize,
    pub found: usize,
    pub late: usize,
    pub missed: usize,
    pub healthy_traces: usize,
    /// Healthy traces with a leak alert.
    pub false_alarms: usize,
    /// `None` when nothing was alerted.
    pub precision: Option<f64>,
    /// `None` without leak traces.
    pub recall: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OomTotals {
    pub oom_traces: usize,
    pub in_time: usize,
    pub late: usize,
    pub missed: usize,
    /// Over the OOM traces warned before the OOM, in time or not.
    pub lead_min_ms: Option<i64>,
    pub lead_median_ms: Option<i64>,
    pub traces_without_oom: usize,
    /// Warnings on traces without an OOM, one per alert…
    pub false_warnings: usize,
    /// …and how many traces they fell on.
    pub traces_falsely_warned: usize,
}

pub(crate) fn score_trace(rules: &RulesConfig, trace: &LabelledTrace) -> TraceScore {
    let (alerts, errors) = backtest::run(rules.clone(), trace.csv.as_bytes());
    let fired = |rule: RuleId| -> Vec<i64> {
        alerts
            .iter()
            .filter(|a| a.rule == rule.as_str())
            .map(|a| a.fired_at_ms)
            .collect()
    };
    let label = &trace.label;
    // A leak trace that names its process is found only by an alert on it;
    // an alert on another of its processes is a false alarm.
    let at_fault = |a: &&backtest::BacktestAlert| match (label.kind, label.pid) {
        (Kind::Leak, Some(pid)) => {
            a.labels.get("pid").map(String::as_str) == Some(&pid.to_string())
        }
        _ => true,
    };
    let leak_alerts = alerts.iter().filter(|a| a.rule == RuleId::Leak.as_str());
    let leak_fired_ms: Vec<i64> = leak_alerts
        .clone()
        .filter(at_fault)
        .map(|a| a.fired_at_ms)
        .collect();
    let wrong_process_leak_alerts = leak_alerts.filter(|a| !at_fault(a)).count();
    let oom_fired_ms = fired(RuleId::TimeToOom);
    let baseline_fired_ms: Vec<i64> = predict_linear::alerts(&trace.csv)
        .iter()
        .map(|a| a.fired_at_ms)
        .collect();
    TraceScore {
        name: trace.name.clone(),
        label: label.clone(),
        start_ms: first_timestamp(&trace.csv).unwrap_or(0),
        rules: Outcome {
            leak: Some(leak_verdict(label, &leak_fired_ms)),
            leak_fired_ms,
            oom: oom_verdict(label, &oom_fired_ms),
            oom_fired_ms,
        },
        predict_linear: Outcome {
            leak: None,
            leak_fired_ms: Vec::new(),
            oom: oom_verdict(label, &baseline_fired_ms),
            oom_fired_ms: baseline_fired_ms,
        },
        watermark_fired_ms: fired(RuleId::Watermark),
        wrong_process_leak_alerts,
        errors: errors.iter().map(ToString::to_string).collect(),
    }
}

fn first_timestamp(csv: &str) -> Option<i64> {
    csv.lines()
        .skip(1)
        .find_map(|line| parse_row(line).ok())
        .map(|row| row.ts)
}

/// `fired_ms` in time order.
fn leak_verdict(label: &Label, fired_ms: &[i64]) -> LeakVerdict {
    match (label.kind, fired_ms.first()) {
        (Kind::Oom, _) => LeakVerdict::NotScored,
        (Kind::None, None) => LeakVerdict::Quiet,
        (Kind::None, Some(&first_at_ms)) => LeakVerdict::FalseAlarm {
            alerts: fired_ms.len(),
            first_at_ms,
        },
        (Kind::Leak, None) => LeakVerdict::Missed,
        (Kind::Leak, Some(&at_ms)) => {
            let deadline = label.leak_found_by_ms.unwrap_or(i64::MAX);
            if at_ms <= deadline {
                LeakVerdict::Found { at_ms }
            } else {
                LeakVerdict::Late {
                    at_ms,
                    late_by_ms: at_ms - deadline,
                }
            }
        }
    }
}

/// `fired_ms` in time order.
fn oom_verdict(label: &Label, fired_ms: &[i64]) -> OomVerdict {
    match label.oom_at_ms {
        Some(oom_at) => match fired_ms.iter().find(|&&at| at < oom_at) {
            None => OomVerdict::Missed,
            Some(&at) => {
                let lead_ms = oom_at - at;
                if lead_ms >= label.min_lead_ms.unwrap_or(0) {
                    OomVerdict::InTime { lead_ms }
                } else {
                    OomVerdict::Late { lead_ms }
                }
            }
        },
        None => match fired_ms.first() {
            None => OomVerdict::Quiet,
            Some(&first_at_ms) => OomVerdict::FalseWarnings {
                alerts: fired_ms.len(),
                first_at_ms,
            },
        },
    }
}

impl Totals {
    fn of(rows: &[TraceScore], outcome: impl Fn(&TraceScore) -> &Outcome) -> Self {
        let outcomes: Vec<(&Label, &Outcome)> =
            rows.iter().map(|r| (&r.label, outcome(r))).collect();
        let has_leak_detection = outcomes.iter().any(|(_, o)| o.leak.is_some());
        Self {
            leak: has_leak_detection.then(|| LeakTotals::of(&outcomes)),
            oom: OomTotals::of(&outcomes),
        }
    }
}

impl LeakTotals {
    fn of(outcomes: &[(&Label, &Outcome)]) -> Self {
        let count = |wanted: fn(&LeakVerdict) -> bool| {
            outcomes
                .iter()
                .filter(|(_, o)| o.leak.as_ref().is_some_and(wanted))
                .count()
        };
        let kinds = |kind: Kind| outcomes.iter().filter(|(l, _)| l.kind == kind).count();
        let found = count(|v| matches!(v, LeakVerdict::Found { .. }));
        let false_alarms = count(|v| matches!(v, LeakVerdict::FalseAlarm { .. }));
        let leak_traces = kinds(Kind::Leak);
        Self {
            leak_traces,
            found,
            late: count(|v| matches!(v, LeakVerdict::Late { .. })),
            missed: count(|v| matches!(v, LeakVerdict::Missed)),
            healthy_traces: kinds(Kind::None),
            false_alarms,
            precision: ratio(found, found + false_alarms),
            recall: ratio(found, leak_traces),
        }
    }
}

impl OomTotals {
    fn of(outcomes: &[(&Label, &Outcome)]) -> Self {
        let mut leads: Vec<i64> = Vec::new();
        let (mut in_time, mut late, mut missed) = (0, 0, 0);
        let (mut false_warnings, mut traces_falsely_warned) = (0, 0);
        for (_, outcome) in outcomes {
            match outcome.oom {
                OomVerdict::InTime { lead_ms } => {
                    in_time += 1;
                    leads.push(lead_ms);
                }
                OomVerdict::Late { lead_ms } => {
                    late += 1;
                    leads.push(lead_ms);
                }
                OomVerdict::Missed => missed += 1,
                OomVerdict::FalseWarnings { alerts, .. } => {
                    false_warnings += alerts;
                    traces_falsely_warned += 1;
                }
                OomVerdict::Quiet => {}
            }
        }
        leads.sort_unstable();
        let oom_traces = outcomes
            .iter()
            .filter(|(l, _)| l.oom_at_ms.is_some())
            .count();
        Self {
            oom_traces,
            in_time,
            late,
            missed,
            lead_min_ms: leads.first().copied(),
            lead_median_ms: median(&leads),
            traces_without_oom: outcomes.len() - oom_traces,
            false_warnings,
            traces_falsely_warned,
        }
    }
}

fn ratio(part: usize, whole: usize) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

/// Of sorted values; the mean of the middle two when their count is even.
fn median(sorted: &[i64]) -> Option<i64> {
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2),
    }
}

/// Minutes, to a tenth.
fn minutes(ms: i64) -> String {
    format!("{:.1}m", ms as f64 / 60_000.0)
}

impl TraceScore {
    /// A time of this trace, as minutes from its start.
    fn when(&self, at_ms: i64) -> String {
        minutes(at_ms - self.start_ms)
    }

    fn leak_cell(&self, outcome: &Outcome) -> String {
        match outcome.leak {
            None => "n/a".into(),
            Some(LeakVerdict::Found { at_ms }) => format!(
                "found {} (by {})",
                self.when(at_ms),
                self.when(self.label.leak_found_by_ms.unwrap_or(at_ms))
            ),
            Some(LeakVerdict::Late { at_ms, late_by_ms }) => {
                format!("LATE {} ({} late)", self.when(at_ms), minutes(late_by_ms))
            }
            Some(LeakVerdict::Missed) => "MISSED".into(),
            Some(LeakVerdict::FalseAlarm {
                alerts,
                first_at_ms,
            }) => format!("FALSE x{alerts} from {}", self.when(first_at_ms)),
            Some(LeakVerdict::Quiet) => "quiet".into(),
            Some(LeakVerdict::NotScored) => match outcome.leak_fired_ms.first() {
                Some(&at) => format!("- ({} from {})", outcome.leak_fired_ms.len(), self.when(at)),
                None => "-".into(),
            },
        }
    }

    fn oom_cell(&self, outcome: &Outcome) -> String {
        let min_lead = self.label.min_lead_ms.unwrap_or(0);
        match outcome.oom {
            OomVerdict::InTime { lead_ms } => format!("lead {}", minutes(lead_ms)),
            OomVerdict::Late { lead_ms } => {
                format!("LATE lead {} < {}", minutes(lead_ms), minutes(min_lead))
            }
            OomVerdict::Missed => "MISSED".into(),
            OomVerdict::FalseWarnings {
                alerts,
                first_at_ms,
            } => format!("FALSE x{alerts} from {}", self.when(first_at_ms)),
            OomVerdict::Quiet => "quiet".into(),
        }
    }

    fn watermark_cell(&self) -> String {
        match self.watermark_fired_ms.first() {
            Some(&at) => format!("{} from {}", self.watermark_fired_ms.len(), self.when(at)),
            None => "-".into(),
        }
    }
}

/// Left-aligned columns two spaces apart.
fn write_table(f: &mut fmt::Formatter<'_>, rows: &[Vec<String>]) -> fmt::Result {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            line.push_str(&format!("{cell:<width$}  "));
        }
        writeln!(f, "{}", line.trim_end())?;
    }
    Ok(())
}

impl fmt::Display for Scorecard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let header = [
            "trace",
            "kind",
            "leak (rules)",
            "time_to_oom (rules)",
            "predict_linear",
            "watermark",
        ];
        let mut rows = vec![header.iter().map(|h| (*h).to_owned()).collect()];
        rows.extend(self.traces.iter().map(|t| {
            vec![
                t.name.clone(),
                t.label.kind.as_str().to_owned(),
                t.leak_cell(&t.rules),
                t.oom_cell(&t.rules),
                t.oom_cell(&t.predict_linear),
                t.watermark_cell(),
            ]
        }));
        write_table(f, &rows)?;
        writeln!(
            f,
            "\nTimes are minutes from the trace's start; a lead is before the OOM. Leak alerts\non oom traces, in brackets, are not scored.\n"
        )?;

        let leak_line = |name: &str, cell: fn(&LeakTotals) -> String| {
            let of = |t: &Totals| t.leak.as_ref().map_or("n/a".to_owned(), cell);
            vec![name.to_owned(), of(&self.rules), of(&self.predict_linear)]
        };
        let oom_line = |name: &str, cell: fn(&OomTotals) -> String| {
            vec![
                name.to_owned(),
                cell(&self.rules.oom),
                cell(&self.predict_linear.oom),
            ]
        };
        let totals = vec![
            vec![
                "".to_owned(),
                "rules".to_owned(),
                "predict_linear".to_owned(),
            ],
            leak_line("leak precision", |t| {
                share(t.precision, t.found, t.found + t.false_alarms)
            }),
            leak_line("leak recall", |t| share(t.recall, t.found, t.leak_traces)),
            leak_line("leaks late / missed", |t| {
                format!("{} / {}", t.late, t.missed)
            }),
            leak_line("healthy traces with a leak alert", |t| {
                format!("{} of {}", t.false_alarms, t.healthy_traces)
            }),
            oom_line("OOM warned in time", |t| {
                format!("{} of {}", t.in_time, t.oom_traces)
            }),
            oom_line("OOM warned late / missed", |t| {
                format!("{} / {}", t.late, t.missed)
            }),
            oom_line("lead min / median", |t| {
                match (t.lead_min_ms, t.lead_median_ms) {
                    (Some(low), Some(mid)) => format!("{} / {}", minutes(low), minutes(mid)),
                    _ => "n/a".into(),
                }
            }),
            oom_line("false OOM warnings", |t| {
                format!(
                    "{} on {} of {} traces",
                    t.false_warnings, t.traces_falsely_warned, t.traces_without_oom
                )
            }),
        ];
        write_table(f, &totals)?;

        let with_errors: Vec<&TraceScore> = self
            .traces
            .iter()
            .filter(|t| !t.errors.is_empty())
            .collect();
        if !with_errors.is_empty() {
            writeln!(f, "\nSkipped lines:")?;
            for t in with_errors {
                for error in &t.errors {
                    writeln!(f, "  {}: {error}", t.name)?;
                }
            }
        }
        Ok(())
    }
}

fn share(value: Option<f64>, part: usize, whole: usize) -> String {
    match value {
        Some(v) => format!("{v:.2} ({part} of {whole})"),
        None => "n/a".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backtest::HEADER;

    const START: i64 = 1_700_000_000_000;
    const MIN: i64 = 60_000;

    fn label(kind: Kind) -> Label {
        Label {
            kind,
            leak_found_by_ms: None,
            oom_at_ms: None,
            min_lead_ms: None,
            pid: None,
            description: String::new(),
        }
    }

    fn leak_label(found_by: i64) -> Label {
        Label {
            leak_found_by_ms: Some(found_by),
            ..label(Kind::Leak)
        }
    }

    fn oom_label(oom_at: i64, min_lead: i64) -> Label {
        Label {
            oom_at_ms: Some(oom_at),
            min_lead_ms: Some(min_lead),
            pid: None,
            ..label(Kind::Oom)
        }
    }

    fn outcome(label: &Label, leak_fired: &[i64], oom_fired: &[i64]) -> Outcome {
        Outcome {
            leak: Some(leak_verdict(label, leak_fired)),
            leak_fired_ms: leak_fired.to_vec(),
            oom: oom_verdict(label, oom_fired),
            oom_fired_ms: oom_fired.to_vec(),
        }
    }

    #[test]
    fn a_leak_alert_on_a_healthy_trace_is_a_false_alarm() {
        let healthy = label(Kind::None);
        assert_eq!(
            leak_verdict(&healthy, &[50 * MIN, 90 * MIN]),
            LeakVerdict::FalseAlarm {
                alerts: 2,
                first_at_ms: 50 * MIN
            }
        );
        assert_eq!(leak_verdict(&healthy, &[]), LeakVerdict::Quiet);
    }

    #[test]
    fn a_leak_is_found_by_its_deadline_or_late_and_oom_traces_are_not_scored() {
        let leak = leak_label(45 * MIN);
        assert_eq!(
            leak_verdict(&leak, &[45 * MIN]),
            LeakVerdict::Found { at_ms: 45 * MIN }
        );
        assert_eq!(
            leak_verdict(&leak, &[50 * MIN]),
            LeakVerdict::Late {
                at_ms: 50 * MIN,
                late_by_ms: 5 * MIN
            }
        );
        assert_eq!(leak_verdict(&leak, &[]), LeakVerdict::Missed);
        assert_eq!(
            leak_verdict(&oom_label(100 * MIN, 0), &[20 * MIN]),
            LeakVerdict::NotScored
        );
    }

    #[test]
    fn the_lead_counts_from_the_first_warning_before_the_oom_only() {
        let oom = oom_label(100 * MIN, 5 * MIN);
        assert_eq!(
            oom_verdict(&oom, &[80 * MIN, 95 * MIN]),
            OomVerdict::InTime { lead_ms: 20 * MIN }
        );
        assert_eq!(
            oom_verdict(&oom, &[97 * MIN]),
            OomVerdict::Late { lead_ms: 3 * MIN }
        );
        // At or after the OOM is no warning.
        assert_eq!(
            oom_verdict(&oom, &[100 * MIN, 101 * MIN]),
            OomVerdict::Missed
        );
        assert_eq!(
            oom_verdict(&label(Kind::Leak), &[10 * MIN, 30 * MIN]),
            OomVerdict::FalseWarnings {
                alerts: 2,
                first_at_ms: 10 * MIN
            }
        );
    }

    #[test]
    fn totals_follow_the_definitions() {
        let healthy = label(Kind::None);
        let leak = leak_label(45 * MIN);
        let oom = oom_label(100 * MIN, 5 * MIN);
        let rows = [
            (&leak, outcome(&leak, &[40 * MIN], &[])),
            (&leak, outcome(&leak, &[60 * MIN], &[70 * MIN])),
            (&healthy, outcome(&healthy, &[30 * MIN], &[])),
            (&healthy, outcome(&healthy, &[], &[5 * MIN, 9 * MIN])),
            (&oom, outcome(&oom, &[20 * MIN], &[70 * MIN])),
            (&oom, outcome(&oom, &[], &[98 * MIN])),
            (&oom, outcome(&oom, &[], &[110 * MIN])),
        ];
        let outcomes: Vec<(&Label, &Outcome)> = rows.iter().map(|(l, o)| (*l, o)).collect();
        let leaks = LeakTotals::of(&outcomes);
        assert_eq!((leaks.found, leaks.late, leaks.missed), (1, 1, 0));
        assert_eq!((leaks.false_alarms, leaks.healthy_traces), (1, 2));
        assert_eq!(leaks.precision, Some(0.5));
        assert_eq!(leaks.recall, Some(0.5));
        let ooms = OomTotals::of(&outcomes);
        assert_eq!((ooms.in_time, ooms.late, ooms.missed), (1, 1, 1));
        assert_eq!(ooms.lead_min_ms, Some(2 * MIN));
        assert_eq!(ooms.lead_median_ms, Some(16 * MIN));
        assert_eq!((ooms.false_warnings, ooms.traces_falsely_warned), (3, 2));
        assert_eq!(ooms.traces_without_oom, 4);
    }

    /// A GPU at 40 GiB for 20 min, then climbing 2 GiB/min to OOM at
    /// minute 40; rows every 5 s.
    fn ramp_trace() -> LabelledTrace {
        const GIB: u64 = 1 << 30;
        let mut csv = format!("{HEADER}\n");
        for t_s in (0..=40 * 60).step_by(5) {
            let used = 40 * GIB + ((t_s - 20 * 60).max(0) as u64) * 2 * GIB / 60;
            csv.push_str(&format!(
                "{},n1,0,,{used},{}\n",
                START + t_s * 1000,
                80 * GIB
            ));
        }
        LabelledTrace {
            name: "ramp".into(),
            label: oom_label(START + 40 * MIN, 5 * MIN),
            csv,
        }
    }

    #[test]
    fn the_baseline_is_scored_as_time_to_oom_warnings_without_leak_figures() {
        let card = score_traces(&RulesConfig::default(), &[ramp_trace()]);
        let row = &card.traces[0];
        assert_eq!(row.start_ms, START);
        assert_eq!(row.predict_linear.leak, None);
        assert_eq!(card.predict_linear.leak, None);
        assert!(card.rules.leak.is_some());
        // predict_linear fires within minutes of the climb's start.
        let first = row.predict_linear.oom_fired_ms[0];
        assert!(
            (START + 25 * MIN..START + 35 * MIN).contains(&first),
            "{}",
            (first - START) / MIN
        );
        assert_eq!(
            row.predict_linear.oom,
            OomVerdict::InTime {
                lead_ms: START + 40 * MIN - first
            }
        );
        assert_eq!(card.predict_linear.oom.in_time, 1);
        let text = card.to_string();
        assert!(text.contains("ramp") && text.contains("n/a"), "{text}");
    }

    #[test]
    fn skipped_lines_are_reported_on_their_trace() {
        let mut trace = ramp_trace();
        trace.csv.push_str("garbage\n");
        let card = score_traces(&RulesConfig::default(), &[trace]);
        assert_eq!(
            card.traces[0].errors.len(),
            1,
            "{:?}",
            card.traces[0].errors
        );
        assert!(card.traces[0].errors[0].starts_with("line "));
        assert!(card.to_string().contains("Skipped lines:"));
    }

    fn labels_error(text: &str) -> String {
        parse_labels(text, Path::new("dir/labels.json"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn labels_file_mistakes_are_named_with_the_file() {
        let e = labels_error("[1, 2]");
        assert!(e.starts_with("dir/labels.json: not a JSON object"), "{e}");
        let e = labels_error("{\"a.csv\": {\"kind\": \"leek\"}}");
        assert!(e.contains("leek") && e.contains("line 1"), "{e}");
        let e = labels_error("{\"a.csv\": {\"kind\": \"none\", \"oom_at\": 5}}");
        assert!(e.contains("unknown field `oom_at`"), "{e}");
        let e = labels_error("{\"a.csv\": {\"kind\": \"oom\", \"min_lead_ms\": 0}}");
        assert_eq!(
            e,
            "dir/labels.json: label of \"a.csv\": kind \"oom\" needs oom_at_ms"
        );
        let e = labels_error("{\"../a.csv\": {\"kind\": \"none\"}}");
        assert!(e.contains("\"../a.csv\" is not a file name"), "{e}");
        assert!(labels_error("{}").contains("names no trace"));
    }

    #[test]
    fn a_missing_labels_file_or_trace_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = score_dir(&RulesConfig::default(), dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("labels.json: cannot read") && e.contains(dir.path().to_str().unwrap()),
            "{e}"
        );
        std::fs::write(
            dir.path().join(LABELS_FILE),
            "{\"gone.csv\": {\"kind\": \"none\"}}",
        )
        .unwrap();
        let e = score_dir(&RulesConfig::default(), dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cannot read trace") && e.contains("gone.csv"),
            "{e}"
        );
    }

    #[test]
    fn the_written_corpus_reads_back_as_the_corpus_and_scores_the_same() {
        let dir = tempfile::tempdir().unwrap();
        corpus::write_corpus(dir.path()).unwrap();
        let traces = corpus::corpus();
        assert_eq!(read_dir(dir.path()).unwrap(), traces);
        // Scoring is what takes the time: one trace of each kind shows that
        // the directory and the memory take the same road.
        // In name order, as a directory is read.
        let few: Vec<LabelledTrace> = [Kind::Leak, Kind::None, Kind::Oom]
            .iter()
            .filter_map(|&kind| traces.iter().find(|t| t.label.kind == kind).cloned())
            .collect();
        let few_dir = tempfile::tempdir().unwrap();
        corpus::write_traces(few_dir.path(), &few).unwrap();
        let rules = RulesConfig::default();
        let from_disk = score_dir(&rules, few_dir.path()).unwrap();
        assert_eq!(from_disk, score_traces(&rules, &few));
        assert_eq!(from_disk.traces.len(), 3);
        assert!(from_disk.traces.iter().all(|t| t.errors.is_empty()));
    }
}
