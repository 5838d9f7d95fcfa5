//! The baseline the rules are scored against: the Prometheus community's
//! GPU-full alert,
//!
//! ```text
//! predict_linear(gpu_used[30m], 3600) > gpu_total
//! ```
//!
//! replayed with Prometheus's semantics over a trace's whole-GPU rows. Each
//! GPU is scraped every 15 s (the newest row of the last 15 s; none, no
//! sample), the rule is evaluated every minute from the GPU's first row to
//! its last, and at each evaluation an ordinary least-squares line through
//! the samples of the 30 minutes up to it (the range is open at its start)
//! is extended 3600 s past the evaluation time. With no `for:`, the alert
//! fires at the first evaluation where that exceeds the total and resolves
//! at the first where it does not; each time it becomes true again is a
//! new alert.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::backtest::parse_row;

const SCRAPE_INTERVAL_MS: i64 = 15_000;
const EVALUATION_INTERVAL_MS: i64 = 60_000;
const RANGE_MS: i64 = 30 * 60_000;
const PREDICT_AHEAD_S: f64 = 3600.0;

/// One alert of the baseline rule.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BaselineAlert {
    /// `node/gpu`.
    pub series: String,
    pub fired_at_ms: i64,
    /// `None` when still firing at the GPU's last row.
    pub resolved_at_ms: Option<i64>,
}

/// A scraped sample: when, memory used, memory total.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    ts: i64,
    used: f64,
    total: f64,
}

/// The baseline's alerts on a trace (CSV text), in fired order. Lines the
/// backtest would refuse, and rows that go back in time for their GPU, are
/// skipped, as the backtest skips them.
pub fn alerts(trace: &str) -> Vec<BaselineAlert> {
    let mut gpus: BTreeMap<String, Vec<Sample>> = BTreeMap::new();
    for line in trace.lines().skip(1) {
        let Ok(row) = parse_row(line) else { continue };
        if row.pid.is_some() {
            continue;
        }
        let readings = gpus.entry(format!("{}/{}", row.node, row.gpu)).or_default();
        if readings.last().is_some_and(|last| row.ts < last.ts) {
            continue;
        }
        readings.push(Sample {
            ts: row.ts,
            used: row.used as f64,
            total: row.total as f64,
        });
    }
    let mut alerts: Vec<BaselineAlert> = gpus
        .iter()
        .flat_map(|(series, readings)| evaluate(series, &scrape(readings)))
        .collect();
    alerts.sort_by(|a, b| (a.fired_at_ms, &a.series).cmp(&(b.fired_at_ms, &b.series)));
    alerts
}

/// What Prometheus would have stored: at each scrape from the first reading
/// on, the newest reading of the interval before it.
fn scrape(readings: &[Sample]) -> Vec<Sample> {
    let (Some(first), Some(last)) = (readings.first(), readings.last()) else {
        return Vec::new();
    };
    let mut samples = Vec::new();
    let mut newer = 0;
    let mut at = first.ts;
    while at <= last.ts {
        while newer < readings.len() && readings[newer].ts <= at {
            newer += 1;
        }
        if let Some(reading) = newer.checked_sub(1).map(|i| readings[i])
            && reading.ts > at - SCRAPE_INTERVAL_MS
        {
            samples.push(Sample { ts: at, ..reading });
        }
        at += SCRAPE_INTERVAL_MS;
    }
    samples
}

fn evaluate(series: &str, samples: &[Sample]) -> Vec<BaselineAlert> {
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        return Vec::new();
    };
    let mut alerts: Vec<BaselineAlert> = Vec::new();
    let mut firing = false;
    let (mut oldest, mut newest) = (0, 0);
    let mut at = first.ts;
    while at <= last.ts {
        while newest < samples.len() && samples[newest].ts <= at {
            newest += 1;
        }
        while oldest < newest && samples[oldest].ts <= at - RANGE_MS {
            oldest += 1;
        }
        let range = &samples[oldest..newest];
        let condition = match (predict_linear(range, at, PREDICT_AHEAD_S), range.last()) {
            (Some(predicted), Some(newest)) => predicted > newest.total,
            _ => false,
        };
        if condition && !firing {
            alerts.push(BaselineAlert {
                series: series.to_owned(),
                fired_at_ms: at,
                resolved_at_ms: None,
            });
        } else if !condition
            && firing
            && let Some(alert) = alerts.last_mut()
        {
            alert.resolved_at_ms = Some(at);
        }
        firing = condition;
        at += EVALUATION_INTERVAL_MS;
    }
    alerts
}

/// Prometheus's `predict_linear`: the least-squares line through the
/// samples, with time in seconds from `at_ms`, read `ahead_s` after it.
/// `None` with fewer than two samples.
fn predict_linear(samples: &[Sample], at_ms: i64, ahead_s: f64) -> Option<f64> {
    if samples.len() < 2 {
        return None;
    }
    let n = samples.len() as f64;
    let (mut sum_x, mut sum_y, mut sum_xy, mut sum_x2) = (0.0, 0.0, 0.0, 0.0);
    for s in samples {
        let x = (s.ts - at_ms) as f64 / 1000.0;
        sum_x += x;
        sum_y += s.used;
        sum_xy += x * s.used;
        sum_x2 += x * x;
    }
    let covariance = sum_xy - sum_x * sum_y / n;
    let variance = sum_x2 - sum_x * sum_x / n;
    let slope = covariance / variance;
    let intercept = sum_y / n - slope * sum_x / n;
    let predicted = intercept + slope * ahead_s;
    predicted.is_finite().then_some(predicted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backtest::HEADER;

    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    const START: i64 = 1_700_000_000_000;

    /// A GPU row every 5 s for `minutes`, `used_gib` of the minute.
    fn trace(minutes: i64, total_gib: f64, used_gib: impl Fn(f64) -> f64) -> String {
        let mut text = format!("{HEADER}\n");
        for t_s in (0..minutes * 60).step_by(5) {
            let used = (used_gib(t_s as f64 / 60.0) * GIB) as u64;
            text.push_str(&format!(
                "{},n1,0,,{used},{}\n",
                START + t_s * 1000,
                (total_gib * GIB) as u64
            ));
        }
        text
    }

    fn minute(m: i64) -> i64 {
        START + m * 60_000
    }

    #[test]
    fn fires_when_the_hour_ahead_crosses_the_total_and_not_before() {
        // 10 GiB + 1 GiB/min: an hour ahead of minute m is 70 + m GiB,
        // over 80.5 GiB from minute 11 on.
        let alerts = alerts(&trace(40, 80.5, |m| 10.0 + m));
        assert_eq!(
            alerts,
            vec![BaselineAlert {
                series: "n1/0".into(),
                fired_at_ms: minute(11),
                resolved_at_ms: None,
            }]
        );
    }

    #[test]
    fn resolves_when_the_slope_fades_and_fires_anew_when_it_returns() {
        // Climbs to minute 20, flat for an hour, climbs again.
        let used = |m: f64| 10.0 + m.min(20.0) + (m - 80.0).max(0.0);
        let alerts = alerts(&trace(120, 80.5, used));
        assert_eq!(alerts.len(), 2, "{alerts:?}");
        assert_eq!(alerts[0].fired_at_ms, minute(11));
        let resolved = alerts[0].resolved_at_ms.unwrap();
        assert!(resolved > minute(20) && resolved < minute(50), "{resolved}");
        assert!(alerts[1].fired_at_ms > minute(80), "{alerts:?}");
        assert_eq!(alerts[1].resolved_at_ms, None);
    }

    #[test]
    fn flat_or_falling_memory_never_fires_even_near_the_total() {
        assert!(alerts(&trace(90, 80.0, |_| 79.0)).is_empty());
        assert!(alerts(&trace(90, 80.0, |m| 79.0 - m / 10.0)).is_empty());
    }

    #[test]
    fn the_line_is_read_an_hour_after_the_evaluation() {
        let samples: Vec<Sample> = (0..=120)
            .map(|i| Sample {
                ts: START + i * 15_000,
                used: 100.0 + 2.0 * (i * 15) as f64,
                total: 1e9,
            })
            .collect();
        let at = START + 120 * 15_000;
        let predicted = predict_linear(&samples, at, 3600.0).unwrap();
        assert!((predicted - (100.0 + 2.0 * (1800.0 + 3600.0))).abs() < 1e-6);
        assert_eq!(predict_linear(&samples[..1], at, 3600.0), None);
    }

    #[test]
    fn a_scrape_takes_the_newest_reading_of_its_interval_or_nothing() {
        let reading = |ts: i64, used: f64| Sample {
            ts,
            used,
            total: 1.0,
        };
        let readings = [
            reading(0, 1.0),
            reading(14_000, 2.0),
            reading(16_000, 3.0),
            reading(60_000, 4.0),
        ];
        let scraped: Vec<(i64, f64)> = scrape(&readings).iter().map(|s| (s.ts, s.used)).collect();
        assert_eq!(
            scraped,
            vec![(0, 1.0), (15_000, 2.0), (30_000, 3.0), (60_000, 4.0)]
        );
    }
}
