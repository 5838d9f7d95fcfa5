//! Steady per-process leak detection.
//!
//! A leak is memory whose *floor* keeps rising: each bucket's minimum
//! discards spikes, sawtooth peaks and jitter, and what is left must grow
//! fast enough, monotonically (Mann–Kendall), and in both halves of the
//! evidence window, so that allocator warm-up that levels off or a single
//! step up does not qualify. Over the window before it as well, the floor
//! must neither have come down (memory following load) nor be slowing down
//! (a cache or warm-up approaching its plateau over tens of minutes).

use crate::trend::{BucketRing, Extreme, downsample_min, mann_kendall, median, theil_sen};

const MINUTE_MS: f64 = 60_000.0;
const MIB: f64 = 1024.0 * 1024.0;

/// Share of the window that must hold buckets before a finding is possible.
const MIN_COVERAGE: f64 = 0.8;
/// A half with fewer points than this cannot be tested.
const MIN_POINTS_PER_HALF: usize = 4;
/// The slower half must climb at least this share of the fastest rate seen
/// (either half's or the whole window's).
const HALF_SHARE_OF_RATE: f64 = 1.0 / 3.0;
/// Memory that fell by more than this share of the window's rise in the
/// last two windows follows load.
const REVERSAL_SHARE: f64 = 0.5;
/// Growth whose recent pace is below this share of its older pace is
/// levelling off. An exponential approach with a time constant of a window
/// shows about 0.37 over two windows, a square-root rise 0.41, a steady
/// leak 1.
const DECELERATION_SHARE: f64 = 0.7;

/// Thresholds of the leak rule.
#[derive(Debug, Clone, PartialEq)]
pub struct LeakConfig {
    /// The evidence window.
    pub window_ms: i64,
    /// A process's first minutes are ignored: allocators and caches warm up.
    pub warmup_ms: i64,
    /// Width of the min-filter buckets.
    pub bucket_ms: i64,
    /// Slower growth is not worth an alert.
    pub min_rate_bytes_per_min: f64,
    /// Mann–Kendall p-value the whole window must reach.
    pub max_p_value: f64,
}

impl Default for LeakConfig {
    fn default() -> Self {
        Self {
            window_ms: 30 * 60_000,
            warmup_ms: 10 * 60_000,
            bucket_ms: 60_000,
            min_rate_bytes_per_min: 8.0 * MIB,
            max_p_value: 0.01,
        }
    }
}

impl LeakConfig {
    fn is_valid(&self) -> bool {
        self.window_ms > 0
            && self.bucket_ms > 0
            && self.warmup_ms >= 0
            && self.min_rate_bytes_per_min.is_finite()
            && self.min_rate_bytes_per_min >= 0.0
            && self.max_p_value > 0.0
            && self.max_p_value <= 1.0
    }
}

/// A leak the rule is confident about.
#[derive(Debug, Clone, PartialEq)]
pub struct LeakFinding {
    /// Theil–Sen slope of the min-filtered memory over the window.
    pub rate_bytes_per_min: f64,
    /// First bucket of the evidence window: the leak has run at least since.
    pub since_ms: i64,
    /// Mann–Kendall p-value over the window.
    pub p_value: f64,
}

/// Leak state for one process on one device, fed one sample at a time.
/// Holds per-bucket minima for one window, never raw samples.
#[derive(Debug, Clone)]
pub struct LeakDetector {
    first_seen_ms: i64,
    ring: BucketRing,
}

impl LeakDetector {
    /// A detector for a process first seen at `first_seen_ms`, retaining
    /// buckets for [`LeakConfig::default`]. Use [`LeakDetector::with_config`]
    /// when evaluating with a longer window: evidence older than the
    /// retained window is gone, so such a detector would never be covered.
    pub fn new(first_seen_ms: i64) -> Self {
        Self::with_config(first_seen_ms, &LeakConfig::default())
    }

    /// A detector whose buckets and retention follow `config`.
    pub fn with_config(first_seen_ms: i64, config: &LeakConfig) -> Self {
        Self {
            first_seen_ms,
            // Two windows: the second is the history the window is judged
            // against (did the growth slow down, or come down before?).
            ring: BucketRing::new(
                config.bucket_ms,
                config.window_ms.saturating_mul(2),
                Extreme::Min,
            ),
        }
    }

    /// Folds in one reading. Out-of-order and duplicate timestamps are
    /// ignored.
    pub fn observe(&mut self, ts_ms: i64, used_bytes: u64) {
        self.ring.push(ts_ms, used_bytes);
    }

    /// The window ending at the newest reading, judged against `config`.
    /// `None` means no leak, or not enough evidence yet.
    pub fn evaluate(&self, config: &LeakConfig) -> Option<LeakFinding> {
        if !config.is_valid() {
            return None;
        }
        let (last_ts, _) = self.ring.last()?;
        let window_start = last_ts.saturating_sub(config.window_ms);
        let warm_from = self.first_seen_ms.saturating_add(config.warmup_ms);
        let from = window_start.max(warm_from);
        let newest_index = last_ts.div_euclid(self.ring.bucket_ms());

        // The bucket still filling is left out: its minimum over a few
        // samples sits above a full bucket's and would fake growth at the end.
        let complete: Vec<(i64, u64)> = self
            .ring
            .buckets()
            .filter(|b| b.index != newest_index && self.ring.start_of(b) >= from)
            .map(|b| (b.value_ts, b.value))
            .collect();
        let covered_ms = (complete.len() as f64) * (self.ring.bucket_ms() as f64);
        if covered_ms < MIN_COVERAGE * config.window_ms as f64 {
            return None;
        }

        let series = downsample_min(&complete, config.bucket_ms);
        if series.len() < 2 * MIN_POINTS_PER_HALF {
            return None;
        }
        let (t0, _) = *series.first()?;
        let points: Vec<(f64, f64)> = series
            .iter()
            .map(|&(ts, v)| ((ts - t0) as f64 / MINUTE_MS, v as f64))
            .collect();

        let fit = theil_sen(&points)?;
        if fit.slope < config.min_rate_bytes_per_min {
            return None;
        }
        let values: Vec<f64> = points.iter().map(|&(_, y)| y).collect();
        let mk = mann_kendall(&values)?;
        if mk.s <= 0 || mk.p_value > config.max_p_value {
            return None;
        }
        let (older, recent) = points.split_at(points.len() / 2);
        // Both halves must climb at a comparable pace: a leak does, while a
        // step up or a warm-up running past its allowance puts nearly all of
        // the rise in one half.
        let (Some(older_rate), Some(recent_rate)) = (half_rate(older), half_rate(recent)) else {
            return None;
        };
        let fastest = fit.slope.max(older_rate).max(recent_rate);
        let slowest = older_rate.min(recent_rate);
        if !(slowest > 0.0 && slowest >= fastest * HALF_SHARE_OF_RATE) {
            return None;
        }
        let rise = fit.slope * (config.window_ms as f64 / MINUTE_MS);
        if !self.keeps_its_pace(config, last_ts, newest_index, rise) {
            return None;
        }
        Some(LeakFinding {
            rate_bytes_per_min: fit.slope,
            since_ms: t0,
            p_value: mk.p_value,
        })
    }
}

impl LeakDetector {
    /// Whether the growth in the window is a leak's rather than load or a
    /// warm-up's, judged over the last two windows (warm-up included) in
    /// coarse buckets of a sixth of a window, which flatten a sawtooth riding
    /// on the floor. Memory that came down in that history by more than
    /// `REVERSAL_SHARE` of the window's rise follows load; growth whose
    /// recent half climbs at less than `DECELERATION_SHARE` of its older
    /// half's pace levels off. A leak neither falls nor slows.
    fn keeps_its_pace(
        &self,
        config: &LeakConfig,
        last_ts: i64,
        newest_index: i64,
        rise: f64,
    ) -> bool {
        let from = last_ts
            .saturating_sub(config.window_ms.saturating_mul(2))
            .max(self.first_seen_ms);
        let minima: Vec<(i64, u64)> = self
            .ring
            .buckets()
            .filter(|b| b.index != newest_index && self.ring.start_of(b) >= from)
            .map(|b| (b.value_ts, b.value))
            .collect();
        let coarse = downsample_min(&minima, (config.window_ms / 6).max(config.bucket_ms));
        let mut high = f64::NEG_INFINITY;
        let mut drawdown: f64 = 0.0;
        for &(_, v) in &coarse {
            high = high.max(v as f64);
            drawdown = drawdown.max(high - v as f64);
        }
        if drawdown > REVERSAL_SHARE * rise {
            return false;
        }
        if coarse.len() < 3 {
            return true;
        }
        let (first, middle, last) = (
            coarse[0],
            coarse[coarse.len() / 2],
            coarse[coarse.len() - 1],
        );
        let rate =
            |a: (i64, u64), b: (i64, u64)| (b.1 as f64 - a.1 as f64) / ((b.0 - a.0).max(1) as f64);
        let (older, recent) = (rate(first, middle), rate(middle, last));
        !(older > 0.0 && recent < DECELERATION_SHARE * older)
    }
}

/// The rate at which one half of the window climbs, when it climbs at all.
///
/// Only the direction is tested here (Theil–Sen not negative, Mann–Kendall
/// `s > 0`), not significance: the whole window already carries that, and a
/// half holding a single riser of a staircase among noisy treads is not
/// significant on its own although it plainly rises. What rejects a flat half
/// is the size of its rate against the other half's.
fn half_rate(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < MIN_POINTS_PER_HALF {
        return None;
    }
    let values: Vec<f64> = points.iter().map(|&(_, y)| y).collect();
    let mk = mann_kendall(&values)?;
    let fit = theil_sen(points)?;
    // `>= 0`, not `> 0`: in a half of an exact staircase where one tread
    // covers most of the half, most pairwise slopes are exactly zero and the
    // median is 0 although the half does rise. For the same reason the rate
    // is the three-group slope, not the Theil–Sen one.
    if fit.slope < 0.0 || mk.s <= 0 {
        return None;
    }
    three_group_slope(points)
}

/// Slope between the medians of the first and last thirds of the points
/// (Wald–Bartlett). Unlike the median pairwise slope it does not collapse to
/// 0 when a staircase's tread covers most of the points.
fn three_group_slope(points: &[(f64, f64)]) -> Option<f64> {
    let third = points.len() / 3;
    if third == 0 {
        return None;
    }
    let (first, last) = (&points[..third], &points[points.len() - third..]);
    let centre = |group: &[(f64, f64)]| {
        let mut xs: Vec<f64> = group.iter().map(|p| p.0).collect();
        let mut ys: Vec<f64> = group.iter().map(|p| p.1).collect();
        Some((median(&mut xs)?, median(&mut ys)?))
    };
    let ((x0, y0), (x1, y1)) = (centre(first)?, centre(last)?);
    let slope = (y1 - y0) / (x1 - x0);
    (x1 > x0 && slope.is_finite()).then_some(slope)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace_fixtures::{GIB, bytes, jitter};

    const MIN_MS: i64 = 60_000;

    /// Feeds `trace(t_s)` once a second for `duration_s`, starting at a
    /// non-round epoch, and evaluates every `every_s`. Returns
    /// `(t_s, finding)` for each evaluation.
    fn run(
        config: &LeakConfig,
        duration_s: i64,
        every_s: i64,
        trace: impl Fn(i64) -> f64,
    ) -> Vec<(i64, Option<LeakFinding>)> {
        let epoch = 1_700_000_000_000;
        let mut detector = LeakDetector::with_config(epoch, config);
        let mut out = Vec::new();
        for t in 0..=duration_s {
            detector.observe(epoch + t * 1000, bytes(trace(t)));
            if t % every_s == 0 {
                let finding = detector.evaluate(config).map(|mut f| {
                    f.since_ms -= epoch;
                    f
                });
                out.push((t, finding));
            }
        }
        out
    }

    fn findings(results: &[(i64, Option<LeakFinding>)]) -> Vec<(i64, &LeakFinding)> {
        results
            .iter()
            .filter_map(|(t, f)| f.as_ref().map(|f| (*t, f)))
            .collect()
    }

    fn assert_quiet(results: &[(i64, Option<LeakFinding>)]) {
        let found = findings(results);
        assert!(found.is_empty(), "unexpected findings: {found:?}");
    }

    /// Whether the leak is reported at every evaluation from `from_s` on,
    /// with a rate within `tolerance` of `rate`.
    fn assert_found_from(
        results: &[(i64, Option<LeakFinding>)],
        from_s: i64,
        rate: f64,
        tolerance: f64,
    ) {
        for (t, finding) in results.iter().filter(|(t, _)| *t >= from_s) {
            let finding = finding
                .as_ref()
                .unwrap_or_else(|| panic!("no finding at t = {t} s"));
            let error = (finding.rate_bytes_per_min - rate).abs() / rate;
            assert!(
                error <= tolerance,
                "rate {:.1} MiB/min at t = {t} s, want {:.1} ± {:.0} %",
                finding.rate_bytes_per_min / MIB,
                rate / MIB,
                tolerance * 100.0
            );
            assert!(finding.p_value <= 0.01);
        }
    }

    /// Earliest time the default window can be covered: warm-up, then 80 %
    /// of the window of complete buckets, plus slack for bucket alignment.
    const FIRST_POSSIBLE_S: i64 = 10 * 60 + 24 * 60 + 120;

    #[test]
    fn finds_a_linear_leak_with_its_rate() {
        let config = LeakConfig::default();
        let rate = 64.0 * MIB;
        let results = run(&config, 2 * 3600, 30, |t| {
            50.0 * GIB + rate * t as f64 / 60.0
        });
        assert_found_from(&results, FIRST_POSSIBLE_S, rate, 0.10);
    }

    #[test]
    fn since_is_the_start_of_the_evidence_window() {
        let config = LeakConfig::default();
        let rate = 64.0 * MIB;
        let results = run(&config, 2 * 3600, 30, |t| {
            50.0 * GIB + rate * t as f64 / 60.0
        });
        for (t, finding) in findings(&results) {
            let t_ms = t * 1000;
            assert!(finding.since_ms >= config.warmup_ms, "{finding:?} at {t}");
            assert!(
                finding.since_ms >= t_ms - config.window_ms,
                "{finding:?} at {t}"
            );
            assert!(
                finding.since_ms <= t_ms - config.window_ms * 4 / 5,
                "{finding:?} at {t}"
            );
        }
        let (_, first) = findings(&results).into_iter().next().unwrap();
        // The first finding's window starts right after warm-up.
        assert!(first.since_ms < config.warmup_ms + 2 * MIN_MS, "{first:?}");
    }

    #[test]
    fn finds_a_step_leak() {
        let config = LeakConfig::default();
        let results = run(&config, 3 * 3600, 30, |t| {
            20.0 * GIB + GIB * (t / 600) as f64
        });
        assert_found_from(&results, FIRST_POSSIBLE_S, GIB / 10.0, 0.30);
    }

    #[test]
    fn finds_a_slow_leak_under_jitter() {
        let config = LeakConfig::default();
        let rate = 20.0 * MIB;
        let results = run(&config, 3 * 3600, 30, |t| {
            30.0 * GIB + rate * t as f64 / 60.0 + jitter(7, t, 256.0 * MIB)
        });
        assert_found_from(&results, FIRST_POSSIBLE_S, rate, 0.10);
    }

    #[test]
    fn quiet_on_steady_memory_with_jitter() {
        let config = LeakConfig::default();
        for seed in 0..4 {
            let results = run(&config, 3 * 3600, 30, |t| {
                40.0 * GIB + jitter(seed, t, 512.0 * MIB)
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn quiet_on_warmup_then_plateau_even_past_the_warmup_allowance() {
        let config = LeakConfig::default();
        // 5, 15 and 20 minutes of ease-out warm-up against a 10 minute
        // allowance.
        for warmup_s in [300.0, 900.0, 1200.0] {
            let results = run(&config, 2 * 3600, 30, |t| {
                let x = (t as f64 / warmup_s).min(1.0);
                let level = 2.0 * GIB + 60.0 * GIB * (1.0 - (1.0 - x) * (1.0 - x));
                level + jitter(3, t, 128.0 * MIB)
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn quiet_on_sawtooth_eval_loops() {
        let config = LeakConfig::default();
        for (period_s, offset_s) in [(300, 0), (300, 77), (420, 13)] {
            let results = run(&config, 3 * 3600, 30, |t| {
                let phase = ((t + offset_s) % period_s) as f64 / period_s as f64;
                30.0 * GIB + 6.0 * GIB * phase + jitter(5, t, 64.0 * MIB)
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn quiet_on_checkpoint_spikes() {
        let config = LeakConfig::default();
        for offset_s in [0, 30] {
            let results = run(&config, 3 * 3600, 30, |t| {
                let t = t + offset_s;
                let base = 40.0 * GIB + jitter(9, t, 64.0 * MIB);
                if t >= 900 && t % 900 < 60 {
                    base + 10.0 * GIB
                } else {
                    base
                }
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn quiet_on_a_one_off_step_up() {
        let config = LeakConfig::default();
        for (seed, amplitude) in [
            (0, 0.0),
            (1, 64.0 * MIB),
            (2, 256.0 * MIB),
            (3, 256.0 * MIB),
        ] {
            let results = run(&config, 3 * 3600, 30, |t| {
                let step = if t >= 3600 { 8.0 * GIB } else { 0.0 };
                30.0 * GIB + step + jitter(seed, t, amplitude)
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn needs_the_window_covered() {
        let config = LeakConfig::default();
        let rate = 256.0 * MIB;
        let leak = |t: i64| 10.0 * GIB + rate * t as f64 / 60.0;
        let results = run(&config, 5 * 60, 10, leak);
        assert_quiet(&results);
        // Even without a warm-up allowance, five minutes is not a window.
        let no_warmup = LeakConfig {
            warmup_ms: 0,
            ..LeakConfig::default()
        };
        assert_quiet(&run(&no_warmup, 5 * 60, 10, leak));
        // Nor is anything short of 80 % of it after warm-up.
        let results = run(&config, FIRST_POSSIBLE_S - 240, 10, leak);
        assert_quiet(&results);
        let covered = run(&no_warmup, 30 * 60, 10, leak);
        assert!(covered.last().unwrap().1.is_some());
    }

    #[test]
    fn a_leak_that_stops_stops_being_reported() {
        let config = LeakConfig::default();
        let rate = 64.0 * MIB;
        let stop_s = 90 * 60;
        let results = run(&config, stop_s + 2 * 3600, 30, |t| {
            let t = t.min(stop_s);
            50.0 * GIB + rate * t as f64 / 60.0 + jitter(11, t, 32.0 * MIB)
        });
        let found_before_stop = findings(&results).iter().any(|(t, _)| *t <= stop_s);
        assert!(found_before_stop);
        let after: Vec<_> = results
            .iter()
            .filter(|(t, _)| *t >= stop_s + config.window_ms / 1000)
            .collect();
        assert!(!after.is_empty());
        assert!(after.iter().all(|(_, f)| f.is_none()), "{after:?}");
    }

    #[test]
    fn out_of_order_and_duplicate_samples_are_ignored() {
        let config = LeakConfig::default();
        let mut detector = LeakDetector::new(0);
        let rate = 64.0 * MIB;
        for t in 0..3600 {
            detector.observe(t * 1000, bytes(50.0 * GIB + rate * t as f64 / 60.0));
            // A stale resend of a low reading would look like a dip.
            detector.observe(t * 1000, 0);
            detector.observe((t - 120).max(0) * 1000, 0);
        }
        let finding = detector.evaluate(&config).unwrap();
        assert!((finding.rate_bytes_per_min / rate - 1.0).abs() < 0.01);
    }

    #[test]
    fn history_stays_bounded() {
        let config = LeakConfig::default();
        let mut detector = LeakDetector::new(0);
        for t in 0..6 * 3600 {
            detector.observe(t * 1000, 1 << 30);
        }
        // The window and the history before it.
        assert!(detector.ring.len() <= 2 * (config.window_ms / config.bucket_ms) as usize + 1);
    }

    #[test]
    fn invalid_config_or_no_data_finds_nothing() {
        let mut detector = LeakDetector::new(0);
        assert_eq!(detector.evaluate(&LeakConfig::default()), None);
        for t in 0..3 * 3600 {
            detector.observe(t * 1000, bytes(GIB + GIB * t as f64 / 60.0));
        }
        assert!(detector.evaluate(&LeakConfig::default()).is_some());
        let broken = [
            LeakConfig {
                window_ms: 0,
                ..LeakConfig::default()
            },
            LeakConfig {
                bucket_ms: 0,
                ..LeakConfig::default()
            },
            LeakConfig {
                max_p_value: f64::NAN,
                ..LeakConfig::default()
            },
            LeakConfig {
                min_rate_bytes_per_min: f64::NAN,
                ..LeakConfig::default()
            },
        ];
        for config in broken {
            assert_eq!(detector.evaluate(&config), None, "{config:?}");
        }
    }

    #[test]
    fn coarser_evaluation_buckets_still_work() {
        // Retained at the default minute, evaluated over two-minute buckets.
        let config = LeakConfig {
            bucket_ms: 2 * MIN_MS,
            ..LeakConfig::default()
        };
        let rate = 64.0 * MIB;
        let mut detector = LeakDetector::new(0);
        for t in 0..2 * 3600 {
            detector.observe(t * 1000, bytes(50.0 * GIB + rate * t as f64 / 60.0));
        }
        let finding = detector.evaluate(&config).unwrap();
        assert!((finding.rate_bytes_per_min / rate - 1.0).abs() < 0.05);
    }

    #[test]
    fn simulated_fleet_flags_only_the_leaking_process() {
        let scenario = headroom_sim::Scenario::from_toml_str(
            r#"
            seed = 3
            [[node]]
            name = "n1"
            [[node.gpu]]
            model = "NVIDIA H100 80GB HBM3"
            memory_total = "80GiB"
            [[node.gpu.process]]
            pid = 10
            name = "leaky"
            memory = { shape = "linear_leak", base = "10GiB", rate_per_min = "64MiB" }
            [[node.gpu.process]]
            pid = 11
            name = "steady"
            memory = { shape = "steady", level = "20GiB", jitter = "512MiB" }
            [[node.gpu.process]]
            pid = 12
            name = "eval"
            memory = { shape = "sawtooth", low = "5GiB", high = "15GiB", period_s = 300 }
            "#,
        )
        .unwrap();
        let node = &scenario.nodes()[0];
        let config = LeakConfig::default();
        let mut detectors: Vec<(u32, LeakDetector)> =
            [10, 11, 12].map(|pid| (pid, LeakDetector::new(0))).into();
        for t in 0..3600 {
            let gpu = &node.state_at(t as f64)[0];
            for (pid, detector) in &mut detectors {
                if let Some(p) = gpu.processes.iter().find(|p| p.pid == *pid) {
                    detector.observe(t * 1000, p.memory_used);
                }
            }
        }
        let flagged: Vec<u32> = detectors
            .iter()
            .filter(|(_, d)| d.evaluate(&config).is_some())
            .map(|(pid, _)| *pid)
            .collect();
        assert_eq!(flagged, vec![10]);
    }
}
