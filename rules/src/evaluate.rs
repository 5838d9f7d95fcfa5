//! Leave-one-family-out evaluation of the memory rules on the generated
//! corpus ([`crate::generator`]), beside the `predict_linear` baseline.
//!
//! Every trace is replayed once per candidate setting of the rules' tuned
//! knobs ([`candidates`]). For each family in turn, the setting is chosen on
//! every *other* family (the one that scores best there) and the withheld
//! family is scored with it; the totals add up those withheld scores, so no
//! figure here was tuned on the traces it counts. What the deployed rules
//! would do (the defaults) is reported beside them.
//!
//! Figures: leak precision and recall with Wilson 95 % intervals, OOM
//! warnings in time (lead ≥ the label's minimum), the lead's median and
//! 10th percentile, and false alarms per 100 GPU-days of healthy traces.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Serialize;

use headroom_common::ByteSize;

use crate::config::{RulesConfig, Span};
use crate::corpus::Kind;
use crate::families::{FAMILIES, Family};
use crate::generator::generate_one;
use crate::score::{LeakVerdict, OomVerdict, TraceScore, score_trace};

/// A setting of the knobs the evaluation tunes: one per leak and one per
/// time-to-OOM knob, zipped, since the two rules never see each other's
/// alerts and one replay can score a leak setting and an OOM setting at
/// once.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub leak_min_rise_mib: u64,
    pub oom_horizon_min: i64,
    pub oom_reach: f64,
}

/// The settings tried: the leak rule's evidence (`min_rise`) around its
/// default, and the OOM forecast's horizon around its default, each with a
/// reach of one and of two windows (how far ahead a climb may be
/// extrapolated). The leak settings repeat, zipped with the OOM ones.
pub fn candidates() -> Vec<Candidate> {
    let leak = [128, 256, 512];
    let oom = [20, 30, 45];
    [1.0, 2.0]
        .into_iter()
        .flat_map(|reach| {
            leak.into_iter()
                .zip(oom)
                .map(move |(leak_min_rise_mib, oom_horizon_min)| Candidate {
                    leak_min_rise_mib,
                    oom_horizon_min,
                    oom_reach: reach,
                })
        })
        .collect()
}

impl Candidate {
    /// The leak knobs of `leak` with the time-to-OOM knobs of `oom`: the
    /// two rules' settings are chosen apart.
    fn combine(leak: &Candidate, oom: &Candidate) -> Candidate {
        Candidate {
            leak_min_rise_mib: leak.leak_min_rise_mib,
            oom_horizon_min: oom.oom_horizon_min,
            oom_reach: oom.oom_reach,
        }
    }

    fn apply(&self, base: &RulesConfig) -> RulesConfig {
        let mut rules = base.clone();
        rules.leak.min_rise = ByteSize(self.leak_min_rise_mib << 20);
        rules.time_to_oom.horizon = Span(self.oom_horizon_min * 60_000);
        rules.time_to_oom.reach = self.oom_reach;
        rules
    }
}

/// What one trace scored under each candidate, and the baseline.
#[derive(Debug, Clone)]
struct Replayed {
    family: &'static str,
    kind: Kind,
    gpu_hours: f64,
    by_candidate: Vec<TraceScore>,
}

/// The median lead (DESIGN.md's goal) a time-to-OOM setting must reach to
/// rank above the settings that fall short of it.
const LEAD_MEDIAN_GOAL_MS: i64 = 15 * 60_000;

/// How a setting ranks: first whether it meets the rule's goal, then its
/// score.
#[derive(Debug, Clone, Copy)]
struct Objective {
    meets_goal: bool,
    score: f64,
}

impl Objective {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.meets_goal
            .cmp(&other.meets_goal)
            .then(self.score.total_cmp(&other.score))
    }
}

/// Counts over a set of traces for one detector.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Tally {
    pub leak_traces: usize,
    pub leaks_found: usize,
    pub healthy_traces: usize,
    /// Leak alerts where there is no leak: per healthy trace alerted, plus
    /// alerts on the wrong process of a leak trace.
    pub leak_false_alarms: usize,
    pub oom_traces: usize,
    pub oom_in_time: usize,
    pub oom_late: usize,
    pub oom_missed: usize,
    /// Leads of every warned OOM, ms.
    pub leads_ms: Vec<i64>,
    /// Time-to-OOM warnings on traces without an OOM.
    pub oom_false_warnings: usize,
    pub healthy_gpu_hours: f64,
    /// Hours of GPU time of traces without an OOM (healthy and leak).
    pub no_oom_gpu_hours: f64,
}

impl Tally {
    fn add(&mut self, kind: Kind, gpu_hours: f64, score: &TraceScore, baseline: bool) {
        let outcome = if baseline {
            &score.predict_linear
        } else {
            &score.rules
        };
        match kind {
            Kind::Leak => self.leak_traces += 1,
            Kind::None => {
                self.healthy_traces += 1;
                self.healthy_gpu_hours += gpu_hours;
            }
            Kind::Oom => self.oom_traces += 1,
        }
        if kind != Kind::Oom {
            self.no_oom_gpu_hours += gpu_hours;
        }
        match outcome.leak {
            Some(LeakVerdict::Found { .. }) => self.leaks_found += 1,
            Some(LeakVerdict::FalseAlarm { .. }) => self.leak_false_alarms += 1,
            _ => {}
        }
        if !baseline {
            self.leak_false_alarms += score.wrong_process_leak_alerts;
        }
        match outcome.oom {
            OomVerdict::InTime { lead_ms } => {
                self.oom_in_time += 1;
                self.leads_ms.push(lead_ms);
            }
            OomVerdict::Late { lead_ms } => {
                self.oom_late += 1;
                self.leads_ms.push(lead_ms);
            }
            OomVerdict::Missed => self.oom_missed += 1,
            OomVerdict::FalseWarnings { alerts, .. } => self.oom_false_warnings += alerts,
            OomVerdict::Quiet => {}
        }
    }

    fn merge(&mut self, other: &Tally) {
        self.leak_traces += other.leak_traces;
        self.leaks_found += other.leaks_found;
        self.healthy_traces += other.healthy_traces;
        self.leak_false_alarms += other.leak_false_alarms;
        self.oom_traces += other.oom_traces;
        self.oom_in_time += other.oom_in_time;
        self.oom_late += other.oom_late;
        self.oom_missed += other.oom_missed;
        self.leads_ms.extend(&other.leads_ms);
        self.oom_false_warnings += other.oom_false_warnings;
        self.healthy_gpu_hours += other.healthy_gpu_hours;
        self.no_oom_gpu_hours += other.no_oom_gpu_hours;
    }

    /// Leak score to choose a setting by: found leaks less false alarms,
    /// each counted as heavily as a missed leak.
    fn leak_objective(&self) -> Objective {
        Objective {
            meets_goal: true,
            score: self.leaks_found as f64 - 2.0 * self.leak_false_alarms as f64,
        }
    }

    /// OOM score: warnings in time less false warnings, which cost more:
    /// an operator who is woken for nothing stops reading the alerts. A
    /// setting whose median lead falls short of the goal (DESIGN.md: 15
    /// min) ranks below every one that meets it: fewer false warnings
    /// bought with warnings too late to act on calmly is not a trade the
    /// goals allow.
    fn oom_objective(&self) -> Objective {
        Objective {
            meets_goal: quantile(&self.sorted_leads(), 0.5)
                .is_none_or(|ms| ms >= LEAD_MEDIAN_GOAL_MS),
            score: self.oom_in_time as f64 - 3.0 * self.oom_false_warnings as f64,
        }
    }

    fn sorted_leads(&self) -> Vec<i64> {
        let mut leads = self.leads_ms.clone();
        leads.sort_unstable();
        leads
    }

    pub fn summary(&self) -> Summary {
        let leads = self.sorted_leads();
        let per_100_days =
            |n: usize, hours: f64| (hours > 0.0).then(|| n as f64 / (hours / 24.0) * 100.0);
        Summary {
            leak_precision: wilson(self.leaks_found, self.leaks_found + self.leak_false_alarms),
            leak_recall: wilson(self.leaks_found, self.leak_traces),
            oom_in_time: wilson(self.oom_in_time, self.oom_traces),
            lead_median_min: quantile(&leads, 0.5).map(|ms| ms as f64 / 60_000.0),
            lead_p10_min: quantile(&leads, 0.1).map(|ms| ms as f64 / 60_000.0),
            leak_false_alarms_per_100_gpu_days: per_100_days(
                self.leak_false_alarms,
                self.healthy_gpu_hours,
            ),
            oom_false_warnings_per_100_gpu_days: per_100_days(
                self.oom_false_warnings,
                self.no_oom_gpu_hours,
            ),
        }
    }
}

/// A proportion with its Wilson 95 % interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Proportion {
    pub part: usize,
    pub whole: usize,
    pub value: Option<f64>,
    pub low: Option<f64>,
    pub high: Option<f64>,
}

/// The Wilson score interval at 95 %: sound at 0 and at 1, where the
/// normal approximation collapses to a point.
pub fn wilson(part: usize, whole: usize) -> Proportion {
    if whole == 0 {
        return Proportion {
            part,
            whole,
            value: None,
            low: None,
            high: None,
        };
    }
    let z = 1.959_964;
    let n = whole as f64;
    let p = part as f64 / n;
    let centre = (p + z * z / (2.0 * n)) / (1.0 + z * z / n);
    let half = z / (1.0 + z * z / n) * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt();
    Proportion {
        part,
        whole,
        value: Some(p),
        low: Some((centre - half).max(0.0)),
        high: Some((centre + half).min(1.0)),
    }
}

fn quantile(sorted: &[i64], q: f64) -> Option<i64> {
    let last = sorted.len().checked_sub(1)?;
    Some(sorted[((last as f64) * q).round() as usize])
}

/// The headline figures of a tally.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub leak_precision: Proportion,
    pub leak_recall: Proportion,
    pub oom_in_time: Proportion,
    pub lead_median_min: Option<f64>,
    pub lead_p10_min: Option<f64>,
    pub leak_false_alarms_per_100_gpu_days: Option<f64>,
    pub oom_false_warnings_per_100_gpu_days: Option<f64>,
}

/// One withheld family: the setting chosen without it, and its score.
#[derive(Debug, Clone, Serialize)]
pub struct FamilyResult {
    pub family: &'static str,
    pub kind: Kind,
    pub source: &'static str,
    pub traces: usize,
    pub chosen: Candidate,
    pub rules: Tally,
    pub defaults: Tally,
    pub predict_linear: Tally,
}

/// The whole evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct Evaluation {
    pub traces: usize,
    pub gpu_days: f64,
    pub per_family: Vec<FamilyResult>,
    /// The withheld scores added up.
    pub rules: Summary,
    /// The rules as configured, on every trace (no tuning either way).
    pub defaults: Summary,
    pub predict_linear: Summary,
    pub candidates: Vec<Candidate>,
    /// The setting chosen on all families: what the defaults should be.
    pub chosen_on_all: Candidate,
}

/// Generates `per_family` traces of each family from `seed`, replays them
/// under every candidate on as many threads as there are cores, and scores
/// each family withheld. `base` is the rules file's configuration; the
/// candidates change only the knobs they name.
pub fn evaluate(base: &RulesConfig, per_family: u64, seed: u64) -> Evaluation {
    evaluate_families(base, FAMILIES, per_family, seed)
}

pub(crate) fn evaluate_families(
    base: &RulesConfig,
    families: &'static [Family],
    per_family: u64,
    seed: u64,
) -> Evaluation {
    let candidates = candidates();
    let configs: Vec<RulesConfig> = candidates.iter().map(|c| c.apply(base)).collect();
    let jobs: Vec<(&'static Family, u64)> = families
        .iter()
        .flat_map(|f| (0..per_family).map(move |i| (f, i)))
        .collect();
    let replayed = replay_all(&jobs, seed, base, &configs);
    // Per family, per candidate (the last index is the base config), the
    // rules' tally; and the baseline's.
    let mut by_family: BTreeMap<&'static str, (Vec<Tally>, Tally, usize)> = BTreeMap::new();
    for r in &replayed {
        let entry = by_family.entry(r.family).or_insert_with(|| {
            (
                vec![Tally::default(); configs.len() + 1],
                Tally::default(),
                0,
            )
        });
        for (i, score) in r.by_candidate.iter().enumerate() {
            entry.0[i].add(r.kind, r.gpu_hours, score, false);
        }
        entry.1.add(r.kind, r.gpu_hours, &r.by_candidate[0], true);
        entry.2 += 1;
    }
    let choose = |exclude: Option<&str>| -> (usize, usize) {
        let mut totals = vec![Tally::default(); configs.len()];
        for (family, (tallies, _, _)) in &by_family {
            if Some(*family) == exclude {
                continue;
            }
            for (t, tally) in totals.iter_mut().zip(tallies) {
                t.merge(tally);
            }
        }
        let best = |objective: fn(&Tally) -> Objective| {
            (0..totals.len())
                .max_by(|&a, &b| {
                    objective(&totals[a])
                        .cmp(&objective(&totals[b]))
                        .then(b.cmp(&a))
                })
                .unwrap_or(0)
        };
        (best(Tally::leak_objective), best(Tally::oom_objective))
    };
    let mut per_family = Vec::new();
    let (mut rules, mut defaults, mut baseline) =
        (Tally::default(), Tally::default(), Tally::default());
    for family in families {
        let Some((tallies, base_tally, traces)) = by_family.get(family.name) else {
            continue;
        };
        let (leak_i, oom_i) = choose(Some(family.name));
        // The withheld family's score: leak figures from the leak setting's
        // replay, OOM figures from the OOM setting's.
        let mut held_out = tallies[oom_i].clone();
        let leak_part = &tallies[leak_i];
        held_out.leaks_found = leak_part.leaks_found;
        held_out.leak_false_alarms = leak_part.leak_false_alarms;
        rules.merge(&held_out);
        defaults.merge(&tallies[configs.len()]);
        baseline.merge(base_tally);
        per_family.push(FamilyResult {
            family: family.name,
            kind: family.kind,
            source: family.source,
            traces: *traces,
            chosen: Candidate::combine(&candidates[leak_i], &candidates[oom_i]),
            rules: held_out,
            defaults: tallies[configs.len()].clone(),
            predict_linear: base_tally.clone(),
        });
    }
    let (leak_all, oom_all) = choose(None);
    Evaluation {
        traces: replayed.len(),
        gpu_days: replayed.iter().map(|r| r.gpu_hours).sum::<f64>() / 24.0,
        per_family,
        rules: rules.summary(),
        defaults: defaults.summary(),
        predict_linear: baseline.summary(),
        chosen_on_all: Candidate::combine(&candidates[leak_all], &candidates[oom_all]),
        candidates,
    }
}

/// Each job generated and replayed under every config and `base` (last),
/// on as many threads as there are cores; traces are dropped once scored.
fn replay_all(
    jobs: &[(&'static Family, u64)],
    seed: u64,
    base: &RulesConfig,
    configs: &[RulesConfig],
) -> Vec<Replayed> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(jobs.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, Replayed)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(family, i)) = jobs.get(index) else {
                            return out;
                        };
                        let g = generate_one(family, i, seed);
                        let by_candidate = configs
                            .iter()
                            .chain(std::iter::once(base))
                            .map(|c| score_trace(c, &g.trace))
                            .collect();
                        out.push((
                            index,
                            Replayed {
                                family: family.name,
                                kind: family.kind,
                                gpu_hours: g.gpu_hours,
                                by_candidate,
                            },
                        ));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| {
                w.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

fn percent(p: &Proportion) -> String {
    match (p.value, p.low, p.high) {
        (Some(v), Some(lo), Some(hi)) => {
            format!("{:.3} [{:.3}, {:.3}] ({}/{})", v, lo, hi, p.part, p.whole)
        }
        _ => "n/a".into(),
    }
}

fn opt(v: Option<f64>, unit: &str) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.1}{unit}"))
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "  leak precision   {}", percent(&self.leak_precision))?;
        writeln!(f, "  leak recall      {}", percent(&self.leak_recall))?;
        writeln!(f, "  OOM in time      {}", percent(&self.oom_in_time))?;
        writeln!(
            f,
            "  OOM lead         median {}, p10 {}",
            opt(self.lead_median_min, " min"),
            opt(self.lead_p10_min, " min")
        )?;
        writeln!(
            f,
            "  false alarms     leak {} and time-to-OOM {} per 100 GPU-days",
            opt(self.leak_false_alarms_per_100_gpu_days, ""),
            opt(self.oom_false_warnings_per_100_gpu_days, "")
        )
    }
}

impl fmt::Display for Evaluation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} generated traces, {} families, {:.1} GPU-days; leave-one-family-out over {} settings",
            self.traces,
            self.per_family.len(),
            self.gpu_days,
            self.candidates.len()
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<28} {:<5} {:>6}  {:<10} {:<22} {:<22}",
            "family (withheld)", "kind", "traces", "chosen", "rules", "predict_linear"
        )?;
        for r in &self.per_family {
            let cell = |t: &Tally| match r.kind {
                Kind::Leak => format!(
                    "found {}/{}, false {}",
                    t.leaks_found, t.leak_traces, t.leak_false_alarms
                ),
                Kind::None => format!(
                    "false leak {}, OOM {}",
                    t.leak_false_alarms, t.oom_false_warnings
                ),
                Kind::Oom => format!(
                    "in time {}/{}, late {}",
                    t.oom_in_time, t.oom_traces, t.oom_late
                ),
            };
            let baseline = match r.kind {
                Kind::Leak => format!("OOM false {}", r.predict_linear.oom_false_warnings),
                _ => cell(&r.predict_linear),
            };
            writeln!(
                f,
                "{:<28} {:<5} {:>6}  {:<10} {:<22} {:<22}",
                r.family,
                r.kind.as_str(),
                r.traces,
                format!(
                    "{}M/{}m×{}",
                    r.chosen.leak_min_rise_mib, r.chosen.oom_horizon_min, r.chosen.oom_reach
                ),
                cell(&r.rules),
                baseline
            )?;
        }
        writeln!(f)?;
        if let Some(worst) = self.worst() {
            writeln!(f, "worst family: {worst}")?;
        }
        writeln!(
            f,
            "rules, each family scored with the setting chosen without it:"
        )?;
        write!(f, "{}", self.rules)?;
        writeln!(f, "rules as configured, every family:")?;
        write!(f, "{}", self.defaults)?;
        writeln!(
            f,
            "predict_linear(gpu_used[30m], 3600) > gpu_total, same traces:"
        )?;
        write!(f, "{}", self.predict_linear)?;
        writeln!(
            f,
            "setting chosen on all families: leak.min_rise {} MiB, time_to_oom.horizon {} min, time_to_oom.reach {}",
            self.chosen_on_all.leak_min_rise_mib,
            self.chosen_on_all.oom_horizon_min,
            self.chosen_on_all.oom_reach
        )
    }
}

impl Evaluation {
    /// The family that scores worst on its own figure: recall for leaks,
    /// warnings in time for OOMs, false alarms for healthy ones.
    pub fn worst(&self) -> Option<String> {
        let figure = |r: &FamilyResult| -> (f64, String) {
            let t = &r.rules;
            match r.kind {
                Kind::Leak => {
                    let v = t.leaks_found as f64 / t.leak_traces.max(1) as f64;
                    (
                        v,
                        format!(
                            "{} recall {:.2} ({}/{})",
                            r.family, v, t.leaks_found, t.leak_traces
                        ),
                    )
                }
                Kind::Oom => {
                    let v = t.oom_in_time as f64 / t.oom_traces.max(1) as f64;
                    (
                        v,
                        format!(
                            "{} in time {:.2} ({}/{})",
                            r.family, v, t.oom_in_time, t.oom_traces
                        ),
                    )
                }
                Kind::None => {
                    let alarms = t.leak_false_alarms + t.oom_false_warnings;
                    let v = 1.0 - alarms as f64 / t.healthy_traces.max(1) as f64;
                    (
                        v,
                        format!(
                            "{} quiet {:.2} ({} false alarms on {} traces)",
                            r.family, v, alarms, t.healthy_traces
                        ),
                    )
                }
            }
        };
        self.per_family
            .iter()
            .map(figure)
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, text)| text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_intervals_hold_the_estimate_and_stay_in_bounds() {
        let all = wilson(20, 20);
        assert_eq!(all.value, Some(1.0));
        assert!(
            all.low.is_some_and(|lo| (0.83..0.84).contains(&lo)),
            "{all:?}"
        );
        assert_eq!(all.high, Some(1.0));
        let half = wilson(50, 100);
        assert!(half.low.is_some_and(|lo| (0.40..0.41).contains(&lo)));
        assert_eq!(wilson(0, 0).value, None);
    }

    #[test]
    fn a_setting_short_of_the_lead_goal_ranks_below_one_that_meets_it() {
        let minutes = |m: &[i64]| m.iter().map(|m| m * 60_000).collect::<Vec<_>>();
        // More in time and fewer false warnings, but a 10-min median lead.
        let late = Tally {
            oom_in_time: 10,
            leads_ms: minutes(&[8, 10, 12]),
            ..Tally::default()
        };
        let meets = Tally {
            oom_in_time: 8,
            oom_false_warnings: 1,
            leads_ms: minutes(&[14, 16, 20]),
            ..Tally::default()
        };
        assert!(late.oom_objective().score > meets.oom_objective().score);
        assert_eq!(
            meets.oom_objective().cmp(&late.oom_objective()),
            std::cmp::Ordering::Greater
        );
        // Among settings that meet it, the score decides.
        let better = Tally {
            oom_false_warnings: 0,
            ..meets.clone()
        };
        assert_eq!(
            better.oom_objective().cmp(&meets.oom_objective()),
            std::cmp::Ordering::Greater
        );
    }
}
