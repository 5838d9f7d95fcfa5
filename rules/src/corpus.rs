//! The labelled corpus: synthetic single-GPU traces, each with what the
//! memory rules should say about it (nothing, a leak by a deadline, an OOM
//! warned ahead by a margin). It is generated in code, so it is the same on
//! every run and needs no data files; `score` measures the rules on it, and
//! [`write_corpus`] puts it on disk in the backtest's CSV format beside its
//! `labels.json`, as the example of a labelled directory.
//!
//! Every trace is one node, one 80 GiB GPU and one process on it, sampled
//! every 2 s: a whole-GPU row (the process plus its ~500 MiB CUDA context)
//! and the process's row. The healthy traces are the shapes that fool naive
//! trend rules (warm-up that levels off, memory that follows load, eval
//! loops, checkpoints, a one-off step); the leaks never come near capacity,
//! so a time-to-OOM warning on them is as false as on a healthy trace.

use std::collections::BTreeMap;
use std::f64::consts::TAU;
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::backtest::HEADER;
use crate::trace_fixtures::{GIB, MIB, bytes, jitter};

/// The file in a labelled directory that names its traces and their labels.
pub const LABELS_FILE: &str = "labels.json";

/// What a trace holds, as far as the memory rules are concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Healthy memory: a leak alert or a time-to-OOM warning is false.
    None,
    /// A leak that stays far from capacity for the whole trace.
    Leak,
    /// Memory that runs out at `oom_at_ms`.
    Oom,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Leak => "leak",
            Self::Oom => "oom",
        }
    }
}

/// What the rules should say about one trace. Times are epoch milliseconds,
/// on the trace's own clock.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Label {
    pub kind: Kind,
    /// Leak traces: a leak alert after this is a miss.
    #[serde(default)]
    pub leak_found_by_ms: Option<i64>,
    /// OOM traces: when memory reaches capacity.
    #[serde(default)]
    pub oom_at_ms: Option<i64>,
    /// OOM traces: the least warning that still leaves time to act.
    #[serde(default)]
    pub min_lead_ms: Option<i64>,
    /// Leak and OOM traces: the process at fault, when the trace names
    /// processes. A leak alert counts only on this process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default)]
    pub description: String,
}

impl Label {
    /// Whether the fields fit the kind; what is wrong when they do not.
    pub fn check(&self) -> Result<(), String> {
        let kind = self.kind.as_str();
        let present = |field: &str, value: Option<i64>, wanted: bool| match (value, wanted) {
            (Some(v), _) if v < 0 => Err(format!("{field} = {v} is negative")),
            (Some(_), false) => Err(format!("kind \"{kind}\" takes no {field}")),
            (None, true) => Err(format!("kind \"{kind}\" needs {field}")),
            _ => Ok(()),
        };
        present(
            "leak_found_by_ms",
            self.leak_found_by_ms,
            self.kind == Kind::Leak,
        )?;
        present("oom_at_ms", self.oom_at_ms, self.kind == Kind::Oom)?;
        present("min_lead_ms", self.min_lead_ms, self.kind == Kind::Oom)
    }
}

/// One trace of the corpus: its name (the file is `NAME.csv`), its label
/// and its text in the backtest's CSV format.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelledTrace {
    pub name: String,
    pub label: Label,
    pub csv: String,
}

impl LabelledTrace {
    pub fn file_name(&self) -> String {
        format!("{}.csv", self.name)
    }
}

/// Every trace starts here (2023-11-14), off any minute boundary so that
/// bucket edges fall mid-sample as they do in production.
const START_MS: i64 = 1_700_000_000_000;
const SAMPLE_S: usize = 2;
const NODE: &str = "corpus-node";
const GPU: &str = "0";
const PID: u32 = 4242;
const TOTAL: f64 = 80.0 * GIB;
const CONTEXT: f64 = 500.0 * MIB;
/// The most the process can hold: what it holds then fills the GPU.
const PROCESS_LIMIT_GIB: f64 = (TOTAL - CONTEXT) / GIB;
/// What the GPU shows in use once its only process has died.
const DRIVER_IDLE: f64 = 16.0 * MIB;
/// Length of most traces: long enough for a leak's deadline (45 min) and
/// the tails of the healthy shapes, and for an OOM's aftermath.
const MINUTES: i64 = 150;
/// A leak is to be reported this long after it starts: the leak rule needs
/// its 30-minute window covered (80 % of it, past a 10-minute warm-up for a
/// new process), so 45 minutes leaves it a few minutes of slack, and a
/// leak found later than that has cost most of an hour of a job.
const LEAK_DEADLINE_MIN: i64 = 45;
/// An OOM warning shorter than this leaves no time to act.
const MIN_LEAD_MIN: i64 = 5;
/// …except for accelerating growth, which no trend sees far ahead.
const MIN_LEAD_ACCELERATING_MIN: i64 = 2;

/// What the trace shows at one sample.
enum Reading {
    /// The process holds this many bytes.
    Process(f64),
    /// The process has died: only the GPU row remains.
    Exited,
}

/// The built-in corpus, sorted by name (which groups it by kind).
pub fn corpus() -> Vec<LabelledTrace> {
    let mut traces = healthy();
    traces.extend(leaks());
    traces.extend(ooms());
    traces.sort_by(|a, b| a.name.cmp(&b.name));
    traces
}

/// Writes each trace as `NAME.csv` and their labels as `labels.json` (an
/// object from file name to label) into `dir`, creating it if need be.
pub fn write_corpus(dir: &Path) -> io::Result<()> {
    write_traces(dir, &corpus())
}

/// [`write_corpus`] for any traces.
pub fn write_traces(dir: &Path, traces: &[LabelledTrace]) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut labels = BTreeMap::new();
    for trace in traces {
        std::fs::write(dir.join(trace.file_name()), &trace.csv)?;
        labels.insert(trace.file_name(), &trace.label);
    }
    let mut json = serde_json::to_string_pretty(&labels).map_err(io::Error::other)?;
    json.push('\n');
    std::fs::write(dir.join(LABELS_FILE), json)
}

fn at_minute(minute: i64) -> i64 {
    START_MS + minute * 60_000
}

fn none(name: &str, description: &str, memory: impl Fn(i64) -> Reading) -> LabelledTrace {
    trace(
        name,
        Label {
            kind: Kind::None,
            leak_found_by_ms: None,
            oom_at_ms: None,
            min_lead_ms: None,
            pid: None,
            description: description.to_owned(),
        },
        MINUTES,
        memory,
    )
}

fn leak(
    name: &str,
    description: &str,
    leak_start_min: i64,
    minutes: i64,
    memory: impl Fn(i64) -> Reading,
) -> LabelledTrace {
    trace(
        name,
        Label {
            kind: Kind::Leak,
            leak_found_by_ms: Some(at_minute(leak_start_min + LEAK_DEADLINE_MIN)),
            oom_at_ms: None,
            min_lead_ms: None,
            pid: None,
            description: description.to_owned(),
        },
        minutes,
        memory,
    )
}

fn oom(
    name: &str,
    description: &str,
    oom_at_min: i64,
    min_lead_min: i64,
    memory: impl Fn(i64) -> Reading,
) -> LabelledTrace {
    trace(
        name,
        Label {
            kind: Kind::Oom,
            leak_found_by_ms: None,
            oom_at_ms: Some(at_minute(oom_at_min)),
            min_lead_ms: Some(min_lead_min * 60_000),
            pid: None,
            description: description.to_owned(),
        },
        MINUTES,
        memory,
    )
}

/// Renders `minutes` of samples; `memory` gets the seconds since the start.
fn trace(name: &str, label: Label, minutes: i64, memory: impl Fn(i64) -> Reading) -> LabelledTrace {
    let total = bytes(TOTAL);
    let mut csv = format!("{HEADER}\n");
    for t_s in (0..minutes * 60).step_by(SAMPLE_S) {
        let ts = START_MS + t_s * 1000;
        match memory(t_s) {
            Reading::Process(held) => {
                let held = bytes(held.clamp(0.0, PROCESS_LIMIT_GIB * GIB));
                let gpu = (held + bytes(CONTEXT)).min(total);
                csv.push_str(&format!("{ts},{NODE},{GPU},,{gpu},{total}\n"));
                csv.push_str(&format!("{ts},{NODE},{GPU},{PID},{held},{total}\n"));
            }
            Reading::Exited => {
                let idle = bytes(DRIVER_IDLE);
                csv.push_str(&format!("{ts},{NODE},{GPU},,{idle},{total}\n"));
            }
        }
    }
    LabelledTrace {
        name: name.to_owned(),
        label,
        csv,
    }
}

/// A process whose memory follows `level_gib` (of the minute) with uniform
/// noise of `noise_mib` either way.
fn steady(seed: u64, noise_mib: f64, level_gib: impl Fn(f64) -> f64) -> impl Fn(i64) -> Reading {
    move |t_s| {
        let minute = t_s as f64 / 60.0;
        Reading::Process(level_gib(minute) * GIB + jitter(seed, t_s, noise_mib * MIB))
    }
}

/// An idle GPU for `idle_min` minutes, then `job` as if it started then.
fn after_idle(idle_min: i64, job: impl Fn(i64) -> Reading) -> impl Fn(i64) -> Reading {
    move |t_s| {
        if t_s < idle_min * 60 {
            Reading::Exited
        } else {
            job(t_s - idle_min * 60)
        }
    }
}

/// A process that follows `level_gib` until it fills the GPU at
/// `oom_at_min`, and dies of it. The noise never reaches the limit early:
/// the OOM is when the label says.
fn until_oom(
    seed: u64,
    oom_at_min: i64,
    level_gib: impl Fn(f64) -> f64,
) -> impl Fn(i64) -> Reading {
    let oom_s = oom_at_min * 60;
    move |t_s| {
        if t_s > oom_s {
            return Reading::Exited;
        }
        if t_s == oom_s {
            return Reading::Process(PROCESS_LIMIT_GIB * GIB);
        }
        let level = level_gib(t_s as f64 / 60.0) * GIB + jitter(seed, t_s, 64.0 * MIB);
        Reading::Process(level.min(PROCESS_LIMIT_GIB * GIB - MIB))
    }
}

fn healthy() -> Vec<LabelledTrace> {
    let mut traces = Vec::new();
    for (tau, plateau) in [(5.0, 65.0), (15.0, 60.0), (30.0, 55.0)] {
        traces.push(none(
            &format!("none_plateau_tau{tau}m"),
            &format!(
                "warm-up from 20 GiB levelling off at {plateau} GiB (exponential, time constant {tau} min)"
            ),
            steady(11, 64.0, move |t| plateau - (plateau - 20.0) * (-t / tau).exp()),
        ));
    }
    traces.push(none(
        "none_sqrt_rise_1h",
        "square-root rise from 20 to 55 GiB over an hour, then flat",
        steady(12, 64.0, |t| 20.0 + 35.0 * (t.min(60.0) / 60.0).sqrt()),
    ));
    traces.push(none(
        "none_log_rise_1h",
        "logarithmic rise from 20 to 55 GiB over an hour, then flat",
        steady(13, 64.0, |t| {
            20.0 + 35.0 * (1.0 + 9.0 * t.min(60.0) / 60.0).ln() / 10f64.ln()
        }),
    ));
    for period in [20.0, 40.0, 60.0] {
        traces.push(none(
            &format!("none_load_sine_{period}m"),
            &format!("KV cache following load: 35 to 55 GiB and back every {period} min"),
            steady(14, 128.0, move |t| 45.0 + 10.0 * (TAU * t / period).sin()),
        ));
    }
    traces.push(none(
        "none_load_irregular",
        "KV cache following irregular load: 35 to 55 GiB, a new level every 4 min, eased, with 256 MiB noise",
        steady(15, 256.0, irregular_load),
    ));
    traces.push(none(
        "none_warmup_plateau",
        "allocator warm-up from 2 to 60 GiB easing out over 20 min (past the leak rule's 10 min allowance), then flat",
        steady(16, 128.0, |t| {
            let x = (t / 20.0).min(1.0);
            2.0 + 58.0 * (1.0 - (1.0 - x) * (1.0 - x))
        }),
    ));
    // Load's first swing, from a trough at the start of the series, with
    // no history to show it coming back: a quarter of the GPU, around two
    // levels, at several periods.
    for (low, high) in [(30.0, 50.0), (40.0, 60.0)] {
        for period in [16.0, 20.0, 30.0, 45.0] {
            traces.push(none(
                &format!("none_load_from_trough_{low:.0}_{high:.0}gib_{period}m"),
                &format!(
                    "KV cache following load from its trough: {low} to {high} GiB and back every {period} min"
                ),
                steady(61, 128.0, move |t| {
                    (low + high) / 2.0 - (high - low) / 2.0 * (TAU * t / period).cos()
                }),
            ));
        }
    }
    for (seed, name) in [(152, "a"), (153, "b"), (154, "c")] {
        traces.push(none(
            &format!("none_load_irregular_5m_{name}"),
            "KV cache following irregular load: 28 to 52 GiB, a new level every 5 min, eased, with 256 MiB noise",
            steady(66, 256.0, move |t| eased_levels(seed, 5.0, 40.0, 12.0, t)),
        ));
    }
    for (minutes, plateau) in [(10.0, 50.0), (15.0, 65.0), (30.0, 67.0), (40.0, 60.0)] {
        traces.push(none(
            &format!("none_warmup_ease_out_{minutes}m_to_{plateau:.0}gib"),
            &format!(
                "warm-up from 5 to {plateau} GiB whose pace falls linearly to zero over {minutes} min"
            ),
            steady(63, 128.0, move |t| {
                let x = (t / minutes).min(1.0);
                5.0 + (plateau - 5.0) * (1.0 - (1.0 - x) * (1.0 - x))
            }),
        ));
    }
    traces.push(none(
        "none_warmup_after_idle",
        "GPU idle for 30 min, then a job whose warm-up eases out from 5 to 60 GiB over 20 min",
        after_idle(
            30,
            steady(62, 128.0, |t| {
                let x = (t / 20.0).min(1.0);
                5.0 + 55.0 * (1.0 - (1.0 - x) * (1.0 - x))
            }),
        ),
    ));
    for (half_min, plateau) in [(5.0, 60.0), (15.0, 67.0)] {
        traces.push(none(
            &format!("none_cache_fill_{half_min}m_to_{plateau:.0}gib"),
            &format!(
                "cache filling from 10 towards {plateau} GiB, half-way after {half_min} min and slower ever after"
            ),
            steady(64, 128.0, move |t| 10.0 + (plateau - 10.0) * t / (t + half_min)),
        ));
    }
    for (tau, plateau) in [(3.0, 67.0), (10.0, 67.0)] {
        traces.push(none(
            &format!("none_plateau_near_capacity_tau{tau}m"),
            &format!(
                "warm-up from 5 GiB levelling off at {plateau} GiB, just below the watermark (exponential, time constant {tau} min)"
            ),
            steady(65, 64.0, move |t| plateau - (plateau - 5.0) * (-t / tau).exp()),
        ));
    }
    traces.push(none(
        "none_eval_sawtooth_5m",
        "eval loop: 30 GiB climbing to 36 GiB over each 5 min, then freed",
        steady(17, 64.0, |t| 30.0 + 6.0 * (t % 5.0) / 5.0),
    ));
    traces.push(none(
        "none_eval_spikes_30m",
        "training at 50 GiB; every 30 min an evaluation climbs 10 GiB over 2 min, holds 3 min and frees it",
        steady(18, 64.0, |t| {
            let phase = t % 30.0;
            if t >= 30.0 && phase < 5.0 {
                50.0 + 10.0 * (phase / 2.0).min(1.0)
            } else {
                50.0
            }
        }),
    ));
    traces.push(none(
        "none_checkpoint_spikes_15m",
        "40 GiB with a 10 GiB checkpoint spike for 1 min every 15 min",
        steady(19, 64.0, |t| {
            if t >= 15.0 && t % 15.0 < 1.0 {
                50.0
            } else {
                40.0
            }
        }),
    ));
    traces.push(none(
        "none_step_up",
        "30 GiB, one step up to 38 GiB at 60 min, flat after",
        steady(20, 64.0, |t| if t < 60.0 { 30.0 } else { 38.0 }),
    ));
    traces.push(none(
        "none_noisy_flat",
        "flat 40 GiB with 512 MiB noise",
        steady(21, 512.0, |_| 40.0),
    ));
    traces
}

/// 45 GiB ± 10 GiB, a new random level every 4 minutes reached by a cosine
/// ease: load that comes and goes with no period.
fn irregular_load(minute: f64) -> f64 {
    eased_levels(151, 4.0, 45.0, 10.0, minute)
}

/// `centre` ± `spread` GiB, a new random level (drawn from `seed`) every
/// `knot_min` minutes, reached by a cosine ease.
fn eased_levels(seed: u64, knot_min: f64, centre: f64, spread: f64, minute: f64) -> f64 {
    let knot = (minute / knot_min).floor();
    let x = minute / knot_min - knot;
    let from = jitter(seed, knot as i64, 1.0);
    let to = jitter(seed, knot as i64 + 1, 1.0);
    let eased = (1.0 - (x * std::f64::consts::PI).cos()) / 2.0;
    centre + spread * (from + (to - from) * eased)
}

fn leaks() -> Vec<LabelledTrace> {
    let mut traces = Vec::new();
    for (rate_mib, from) in [(20.0, 25.0), (50.0, 25.0), (150.0, 20.0)] {
        traces.push(leak(
            &format!("leak_linear_{rate_mib}mib_per_min"),
            &format!("linear leak of {rate_mib} MiB/min from {from} GiB"),
            0,
            MINUTES,
            steady(31, 64.0, move |t| from + rate_mib * t / 1024.0),
        ));
    }
    traces.push(leak(
        "leak_staircase_512mib_every_5m",
        "staircase leak: 512 MiB more every 5 min from 30 GiB",
        0,
        MINUTES,
        steady(32, 64.0, |t| 30.0 + 0.5 * (t / 5.0).floor()),
    ));
    traces.push(leak(
        "leak_staircase_1gib_every_10m",
        "staircase leak: 1 GiB more every 10 min from 25 GiB",
        0,
        MINUTES,
        steady(33, 64.0, |t| 25.0 + (t / 10.0).floor()),
    ));
    traces.push(leak(
        "leak_noisy_30mib_per_min",
        "30 MiB/min leak from 30 GiB under 512 MiB noise",
        0,
        MINUTES,
        steady(34, 512.0, |t| 30.0 + 30.0 * t / 1024.0),
    ));
    traces.push(leak(
        "leak_late_start_1h",
        "flat 30 GiB for an hour, then a 60 MiB/min leak",
        60,
        180,
        steady(35, 64.0, |t| 30.0 + 60.0 * (t - 60.0).max(0.0) / 1024.0),
    ));
    traces.push(leak(
        "leak_on_sawtooth",
        "50 MiB/min leak under an eval loop climbing 4 GiB over each 5 min and freeing it",
        0,
        MINUTES,
        steady(36, 64.0, |t| {
            30.0 + 50.0 * t / 1024.0 + 4.0 * (t % 5.0) / 5.0
        }),
    ));
    traces
}

fn ooms() -> Vec<LabelledTrace> {
    let mut traces = Vec::new();
    // Each ramp is written backwards from the OOM so that it reaches the
    // limit exactly then.
    for (rate_gib, name, from, oom_at) in [
        (200.0 / 1024.0, "oom_linear_200mib_per_min", 55.0, 140),
        (1.0, "oom_linear_1gib_per_min", 30.0, 100),
        (3.0, "oom_linear_3gib_per_min", 40.0, 90),
    ] {
        traces.push(oom(
            name,
            &format!(
                "flat {from} GiB, then a linear climb of {:.0} MiB/min to OOM at {oom_at} min",
                rate_gib * 1024.0
            ),
            oom_at,
            MIN_LEAD_MIN,
            until_oom(41, oom_at, move |t| {
                (PROCESS_LIMIT_GIB - rate_gib * (oom_at as f64 - t)).max(from)
            }),
        ));
    }
    traces.push(oom(
        "oom_quadratic",
        "flat 30 GiB, then a quadratic climb from 40 min to OOM at 100 min",
        100,
        MIN_LEAD_ACCELERATING_MIN,
        until_oom(42, 100, |t| {
            let x = ((t - 40.0) / 60.0).max(0.0);
            30.0 + (PROCESS_LIMIT_GIB - 30.0) * x * x
        }),
    ));
    traces.push(oom(
        "oom_exponential",
        "flat 20 GiB, then an exponential climb (time constant 12 min) from 40 min to OOM at 100 min",
        100,
        MIN_LEAD_ACCELERATING_MIN,
        until_oom(43, 100, |t| {
            let growth = |m: f64| (m / 12.0).exp() - 1.0;
            20.0 + (PROCESS_LIMIT_GIB - 20.0) * growth((t - 40.0).max(0.0)) / growth(60.0)
        }),
    ));
    traces.push(oom(
        "oom_from_job_start",
        "a job climbing linearly from 10 GiB at its start to OOM at 30 min",
        30,
        MIN_LEAD_MIN,
        until_oom(67, 30, |t| 10.0 + (PROCESS_LIMIT_GIB - 10.0) * t / 30.0),
    ));
    traces.push(oom(
        "oom_after_idle",
        "GPU idle for 30 min, then a job climbing linearly from 10 GiB at its start to OOM at 60 min",
        60,
        MIN_LEAD_MIN,
        after_idle(
            30,
            until_oom(70, 30, |t| 10.0 + (PROCESS_LIMIT_GIB - 10.0) * t / 30.0),
        ),
    ));
    // Growth that slows down, towards a level beyond capacity.
    for (name, start_min, oom_at) in [
        ("oom_overshooting_plateau_from_job_start", 0, 42),
        ("oom_overshooting_plateau", 60, 102),
    ] {
        traces.push(oom(
            name,
            &format!(
                "flat 20 GiB until {start_min} min, then levelling off towards 100 GiB, slower and slower, to OOM at {oom_at} min"
            ),
            oom_at,
            MIN_LEAD_MIN,
            until_oom(68, oom_at, move |t| overshooting_plateau(start_min, oom_at, t)),
        ));
    }
    traces.push(oom(
        "oom_stepwise",
        "31.5 GiB, then 4 GiB more every 5 min from 55 min to OOM at 110 min",
        110,
        MIN_LEAD_MIN,
        until_oom(44, 110, |t| {
            let steps_left = ((110.0 - t) / 5.0).ceil();
            (PROCESS_LIMIT_GIB - 4.0 * steps_left).max(PROCESS_LIMIT_GIB - 48.0)
        }),
    ));
    traces
}

/// 20 GiB until `start_min`, then an exponential approach to 100 GiB timed
/// to reach the process's limit at `oom_at_min`.
fn overshooting_plateau(start_min: i64, oom_at_min: i64, minute: f64) -> f64 {
    const FROM: f64 = 20.0;
    const TOWARDS: f64 = 100.0;
    let climb_min = (oom_at_min - start_min) as f64;
    let tau = climb_min / ((TOWARDS - FROM) / (TOWARDS - PROCESS_LIMIT_GIB)).ln();
    let t = (minute - start_min as f64).max(0.0);
    TOWARDS - (TOWARDS - FROM) * (-t / tau).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(ts, pid, used)` of each row.
    fn rows(trace: &LabelledTrace) -> Vec<(i64, Option<u32>, u64)> {
        trace
            .csv
            .lines()
            .skip(1)
            .map(|line| {
                let f: Vec<&str> = line.split(',').collect();
                (
                    f[0].parse().unwrap(),
                    f[3].parse().ok(),
                    f[4].parse().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn the_corpus_is_the_same_every_time() {
        assert_eq!(corpus(), corpus());
    }

    #[test]
    fn every_label_is_consistent_and_every_name_unique() {
        let traces = corpus();
        let mut names: Vec<&str> = traces.iter().map(|t| t.name.as_str()).collect();
        names.dedup();
        assert_eq!(names.len(), traces.len());
        for kind in [Kind::None, Kind::Leak, Kind::Oom] {
            assert!(traces.iter().filter(|t| t.label.kind == kind).count() >= 6);
        }
        for t in &traces {
            t.label
                .check()
                .unwrap_or_else(|e| panic!("{}: {e}", t.name));
            assert!(t.name.starts_with(t.label.kind.as_str()), "{}", t.name);
            assert!(!t.label.description.is_empty());
        }
    }

    #[test]
    fn traces_last_two_to_three_hours_at_two_second_samples() {
        for t in corpus() {
            let rows = rows(&t);
            let span = rows.last().unwrap().0 - rows[0].0;
            assert!(
                (2 * 3_600_000..=3 * 3_600_000).contains(&(span + 2000)),
                "{}",
                t.name
            );
            // One GPU row per sample, and the process's (while it lives)
            // at the same time.
            let gpu_times: Vec<i64> = rows.iter().filter(|r| r.1.is_none()).map(|r| r.0).collect();
            assert!(
                gpu_times.windows(2).all(|w| w[1] - w[0] == 2000),
                "{}",
                t.name
            );
            assert!(
                rows.iter()
                    .filter(|r| r.1.is_some())
                    .all(|r| gpu_times.binary_search(&r.0).is_ok()),
                "{}: GPU and process rows share a time",
                t.name
            );
        }
    }

    #[test]
    fn ooms_fill_the_gpu_exactly_at_their_label_and_nothing_else_comes_close() {
        let total = bytes(TOTAL);
        for t in corpus() {
            let rows = rows(&t);
            let gpu_peak = |until: i64| {
                rows.iter()
                    .filter(|r| r.1.is_none() && r.0 < until)
                    .map(|r| r.2)
                    .max()
                    .unwrap()
            };
            match t.label.oom_at_ms {
                Some(oom) => {
                    assert!(gpu_peak(oom) < total, "{}", t.name);
                    let at_oom: Vec<_> = rows.iter().filter(|r| r.0 == oom).collect();
                    assert_eq!(at_oom.len(), 2, "{}", t.name);
                    assert_eq!(at_oom[0].2, total, "{}", t.name);
                    // Two minutes before, it is already close.
                    let before = rows
                        .iter()
                        .find(|r| r.0 == oom - 120_000 && r.1.is_none())
                        .unwrap();
                    assert!(before.2 as f64 > 0.8 * TOTAL, "{}", t.name);
                    assert!(
                        rows.iter().all(|r| r.0 <= oom || r.1.is_none()),
                        "{}: the process dies of it",
                        t.name
                    );
                }
                // Below the watermark's 90 %, and far enough that a leak
                // extrapolated an hour ahead stays short of capacity.
                None => assert!((gpu_peak(i64::MAX) as f64) < 0.85 * TOTAL, "{}", t.name),
            }
            if t.label.kind == Kind::Leak {
                assert!((gpu_peak(i64::MAX) as f64) < 60.0 * GIB, "{}", t.name);
            }
        }
    }

    #[test]
    fn labels_name_what_their_kind_lacks_or_should_not_have() {
        let mut label = Label {
            kind: Kind::Oom,
            leak_found_by_ms: None,
            oom_at_ms: None,
            min_lead_ms: Some(0),
            pid: None,
            description: String::new(),
        };
        assert_eq!(label.check().unwrap_err(), "kind \"oom\" needs oom_at_ms");
        label.oom_at_ms = Some(5);
        label.leak_found_by_ms = Some(5);
        assert_eq!(
            label.check().unwrap_err(),
            "kind \"oom\" takes no leak_found_by_ms"
        );
        label.kind = Kind::Leak;
        label.oom_at_ms = None;
        label.min_lead_ms = Some(-1);
        assert_eq!(label.check().unwrap_err(), "min_lead_ms = -1 is negative");
    }
}
