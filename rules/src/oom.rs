//! Time-to-OOM forecasting, from the definition in docs/rules.md: warn when
//! the memory in use is forecast to reach what can be allocated within the
//! horizon, on the evidence of a climb that is visible, still going and new.
//!
//! A **climb** is judged on one series' peaks (the GPU's, or one process's:
//! the OOM happens at a peak) over a window, in 20 buckets of maxima:
//!
//! 1. a monotone trend (Mann–Kendall) with a Theil–Sen slope > 0;
//! 2. growth in both halves of the window, each by more than the peaks'
//!    scatter around the trend (a climb, not a single step);
//! 3. no single step between neighbouring peaks carries half the rise or
//!    more (a spike's edge, one allocation: a jump, not a climb);
//! 4. still climbing: the newest peak is the window's highest, and the
//!    highest of the last three peaks stands above the highest of the
//!    three before by half the window's pace (a climb that stopped, with
//!    load swinging around where it stopped, makes peaks as high, not
//!    higher);
//! 5. new memory: above every peak of the series in the `lookback` before
//!    the window (load coming back to a level it held is not a forecast).
//!
//! Its **growth** ahead follows the paces of its two halves: at the second
//! half's pace when it did not slow down, and decaying geometrically at the
//! rate it slowed down otherwise, so that growth that levels off below the
//! limit forecasts no OOM and growth slowing towards a level past the limit
//! still does.
//!
//! The **forecast** is the sooner of the GPU's own climb and the sum of its
//! processes' climbs, each judged alone: a new process climbing beside a
//! steady or swinging one is forecast from its own climb even when the
//! GPU's total is too mixed to show one. Two windows are judged, `window`
//! and three times it, so that a climb in steps minutes apart is seen as one.

use std::collections::HashMap;

use crate::trend::{BucketRing, Extreme, mann_kendall, median, slope_quantiles, theil_sen};

/// Base buckets of peaks; windows coarsen them.
const BASE_BUCKET_MS: i64 = 10_000;
/// Buckets a window is cut into.
const BUCKETS: usize = 20;
/// Fewest buckets with data for a window to be judged.
const MIN_BUCKETS: usize = 16;
/// No single step between neighbouring peaks may carry more than this share
/// of a climb's rise: a climb in steps shows several within its window.
const MAX_STEP_SHARE: f64 = 0.5;
/// The slower window is this many times `window`.
const LONG_WINDOW_FACTOR: i64 = 3;
/// Each half's rise must exceed this many robust standard deviations of
/// the peaks' scatter around the trend.
const HALF_RISE_OVER_SCATTER: f64 = 2.0;
/// The newest peak may sit this many scatter deviations below the window's
/// highest and still be "the highest".
const STILL_CLIMBING_SCATTER: f64 = 1.0;
/// The highest of the newest this many peaks must stand above the highest
/// of as many before them…
const STILL_CLIMBING_BUCKETS: usize = 3;
/// …by this share of the window's pace over them, or more (as the leak
/// rule's still-growing test, on peaks instead of floors).
const STILL_CLIMBING_SHARE: f64 = 0.5;
/// A process unheard of for this long no longer counts towards the GPU's
/// forecast.
const PROCESS_FRESH_MS: i64 = 30_000;
/// A process unheard of for this long is forgotten.
const PROCESS_FORGET_MS: i64 = 5 * 60_000;

/// Thresholds of the time-to-OOM rule.
#[derive(Debug, Clone, PartialEq)]
pub struct OomConfig {
    /// The shorter window a climb is judged over.
    pub window_ms: i64,
    /// No forecast from a series younger than this.
    pub min_history_ms: i64,
    /// Warn when the OOM is forecast sooner than this.
    pub horizon_ms: i64,
    /// A climb must pass every peak of its series this far back.
    pub lookback_ms: i64,
    /// Mann–Kendall p-value a climb's peaks must reach.
    pub max_p_value: f64,
    /// A forecast reaches at most this many times the span of the climb
    /// it stands on: a climb seen for 10 min says little about minute 25.
    pub reach: f64,
}

impl Default for OomConfig {
    fn default() -> Self {
        Self {
            window_ms: 10 * 60_000,
            min_history_ms: 5 * 60_000,
            horizon_ms: 30 * 60_000,
            lookback_ms: 120 * 60_000,
            max_p_value: 0.01,
            reach: 2.0,
        }
    }
}

impl OomConfig {
    fn is_valid(&self) -> bool {
        self.window_ms >= BUCKETS as i64 * BASE_BUCKET_MS
            && self.horizon_ms > 0
            && self.min_history_ms >= 0
            && self.lookback_ms >= 0
            && self.max_p_value > 0.0
            && self.max_p_value <= 1.0
            && self.reach.is_finite()
            && self.reach > 0.0
    }

    fn retention_ms(&self) -> i64 {
        (self.window_ms * LONG_WINDOW_FACTOR).saturating_add(self.lookback_ms)
    }
}

/// An OOM forecast within the horizon.
#[derive(Debug, Clone, PartialEq)]
pub struct OomPrediction {
    pub predicted_oom_at_ms: i64,
    /// At the fast end of the slope band (90th percentile pairwise slope).
    pub earliest_ms: i64,
    /// At the slow end (10th percentile); `i64::MAX` when that slope is not
    /// positive: the data are also consistent with no OOM at all.
    pub latest_ms: i64,
    /// The pace memory grows at now.
    pub growth_bytes_per_s: f64,
    /// One minus the climb's Mann–Kendall p-value (1 at the limit).
    pub confidence: f64,
    /// The window the forecast climb was judged over.
    pub window_ms: i64,
    /// How much the memory rose over that window.
    pub risen_bytes: f64,
    /// The process whose climb leads the forecast, when it is a process's.
    pub pid: Option<u32>,
}

/// A climb of one series over one window, and the growth it forecasts.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Climb {
    /// Pace now (bytes/s): the window's second half.
    rate: f64,
    /// Geometric decay of the pace (1/s); 0 when it is not slowing.
    decay: f64,
    /// 10th and 90th percentile pairwise slopes (bytes/s).
    band: (f64, f64),
    p_value: f64,
    risen: f64,
}

impl Climb {
    /// Growth within `t_s` seconds from now.
    fn growth(&self, t_s: f64) -> f64 {
        if self.decay <= 0.0 {
            self.rate * t_s
        } else {
            self.rate * (1.0 - (-self.decay * t_s).exp()) / self.decay
        }
    }
}

/// Peaks of one series.
#[derive(Debug, Clone)]
struct Peaks {
    first_ms: i64,
    last_seen_ms: i64,
    ring: BucketRing,
}

impl Peaks {
    fn new(config: &OomConfig, ts_ms: i64) -> Self {
        Self {
            first_ms: ts_ms,
            last_seen_ms: ts_ms,
            ring: BucketRing::new(BASE_BUCKET_MS, config.retention_ms(), Extreme::Max),
        }
    }

    fn observe(&mut self, ts_ms: i64, used: u64) {
        if self.ring.push(ts_ms, used) {
            self.last_seen_ms = ts_ms;
        }
    }

    /// The climb over `window_ms` ending with the newest bucket, if the
    /// peaks show one.
    fn climb(&self, config: &OomConfig, window_ms: i64, now_ms: i64) -> Option<Climb> {
        if now_ms - self.first_ms < config.min_history_ms {
            return None;
        }
        let width = (window_ms / BASE_BUCKET_MS / BUCKETS as i64).max(1);
        let newest = self.ring.last()?.0.div_euclid(BASE_BUCKET_MS);
        // Buckets of `width` base buckets, the newest (still filling) last.
        let end = newest + 1;
        let from = end - width * BUCKETS as i64;
        let back_from = from - config.lookback_ms / BASE_BUCKET_MS;
        let mut peaks = [f64::NAN; BUCKETS];
        let mut held = f64::NAN;
        for b in self.ring.buckets() {
            let v = b.value as f64;
            if b.index >= from {
                let i = ((b.index - from) / width) as usize;
                if i < BUCKETS {
                    peaks[i] = if peaks[i].is_nan() {
                        v
                    } else {
                        peaks[i].max(v)
                    };
                }
            } else if b.index >= back_from {
                held = if held.is_nan() { v } else { held.max(v) };
            }
        }
        let seconds = (width * BASE_BUCKET_MS) as f64 / 1000.0;
        let points: Vec<(f64, f64)> = peaks
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| ((i as f64 + 0.5) * seconds, v))
            .collect();
        if points.len() < MIN_BUCKETS || peaks[BUCKETS - 1].is_nan() {
            return None;
        }
        let fit = theil_sen(&points)?;
        if fit.slope <= 0.0 {
            return None;
        }
        let values: Vec<f64> = points.iter().map(|p| p.1).collect();
        let p_value = mann_kendall(&values)?.p_value;
        if p_value >= config.max_p_value {
            return None;
        }
        let mut residuals: Vec<f64> = points.iter().map(|&(x, y)| (y - fit.at(x)).abs()).collect();
        let scatter = 1.4826 * median(&mut residuals)?;
        let half = BUCKETS as f64 * seconds / 2.0;
        let (first, second): (Vec<_>, Vec<_>) = points.iter().partition(|p| p.0 < half);
        let rise_of = |part: &[(f64, f64)]| -> Option<(f64, f64)> {
            let slope = theil_sen(part)?.slope;
            let (lo, hi) = (part.first()?.0, part.last()?.0);
            Some((slope, slope * (hi - lo).max(seconds)))
        };
        let ((early, early_rise), (late, late_rise)) = (rise_of(&first)?, rise_of(&second)?);
        let enough = HALF_RISE_OVER_SCATTER * scatter;
        if early <= 0.0 || late <= 0.0 || early_rise <= enough || late_rise <= enough {
            return None;
        }
        // A climb, not a jump: no step between neighbouring peaks carries
        // most of the rise (a spike's edge, a one-off allocation).
        let rise = fit.slope * BUCKETS as f64 * seconds;
        let largest_step = values.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
        if largest_step > MAX_STEP_SHARE * rise {
            return None;
        }
        let newest_peak = peaks[BUCKETS - 1];
        let highest = values.iter().copied().fold(f64::MIN, f64::max);
        if newest_peak < highest - STILL_CLIMBING_SCATTER * scatter {
            return None;
        }
        // Still climbing: the highest of the newest peaks stands above the
        // highest of as many before them by half the window's pace. A climb
        // that stopped, with load swinging around where it stopped, keeps
        // making peaks as high as its last, but no higher.
        let top = |from: usize, to: usize| {
            peaks[from..to]
                .iter()
                .copied()
                .filter(|v| !v.is_nan())
                .fold(f64::NAN, f64::max)
        };
        let recent = STILL_CLIMBING_BUCKETS;
        let (now_top, before_top) = (
            top(BUCKETS - recent, BUCKETS),
            top(BUCKETS - 2 * recent, BUCKETS - recent),
        );
        if before_top.is_nan()
            || now_top - before_top < STILL_CLIMBING_SHARE * fit.slope * recent as f64 * seconds
        {
            return None;
        }
        if !held.is_nan() && newest_peak <= held {
            return None;
        }
        let decay = if late < early {
            (early / late).ln() / half
        } else {
            0.0
        };
        let band = slope_quantiles(&points, 0.1, 0.9)?;
        Some(Climb {
            rate: late,
            decay,
            band,
            p_value,
            risen: rise,
        })
    }
}

/// Time-to-OOM state for one GPU or MIG instance: its own peaks and those
/// of each process on it.
#[derive(Debug, Clone)]
pub struct OomPredictor {
    retention: OomConfig,
    device: Option<Peaks>,
    processes: HashMap<(u32, i64), Peaks>,
}

impl Default for OomPredictor {
    fn default() -> Self {
        Self::new()
    }
}

impl OomPredictor {
    pub fn new() -> Self {
        Self::with_config(&OomConfig::default())
    }

    /// A predictor retaining what `config`'s windows and lookback need.
    pub fn with_config(config: &OomConfig) -> Self {
        Self {
            retention: config.clone(),
            device: None,
            processes: HashMap::new(),
        }
    }

    /// Folds in one reading of the device's peak. Out-of-order and
    /// duplicate timestamps are ignored.
    pub fn observe(&mut self, ts_ms: i64, used_bytes: u64) {
        let retention = &self.retention;
        self.device
            .get_or_insert_with(|| Peaks::new(retention, ts_ms))
            .observe(ts_ms, used_bytes);
    }

    /// Folds in one reading of a process on the device.
    pub fn observe_process(&mut self, pid: u32, start_ms: i64, ts_ms: i64, used_bytes: u64) {
        let retention = &self.retention;
        self.processes
            .entry((pid, start_ms))
            .or_insert_with(|| Peaks::new(retention, ts_ms))
            .observe(ts_ms, used_bytes);
    }

    /// `limit_bytes`: what can be allocated (total − reserved); `used_bytes`
    /// what is in use now. `Some` only when an OOM is forecast within the
    /// horizon, or the memory is already at the limit.
    pub fn evaluate(
        &mut self,
        config: &OomConfig,
        limit_bytes: u64,
        used_bytes: u64,
        now_ms: i64,
    ) -> Option<OomPrediction> {
        self.processes
            .retain(|_, p| now_ms - p.last_seen_ms <= PROCESS_FORGET_MS);
        // A zero limit means the capacity is unknown, not that it is full.
        if !config.is_valid() || limit_bytes == 0 {
            return None;
        }
        let headroom = limit_bytes.saturating_sub(used_bytes) as f64;
        if headroom <= 0.0 {
            return Some(OomPrediction {
                predicted_oom_at_ms: now_ms,
                earliest_ms: now_ms,
                latest_ms: now_ms,
                growth_bytes_per_s: 0.0,
                confidence: 1.0,
                window_ms: 0,
                risen_bytes: 0.0,
                pid: None,
            });
        }
        let horizon_s = config.horizon_ms as f64 / 1000.0;
        let mut best: Option<OomPrediction> = None;
        for window_ms in [config.window_ms, config.window_ms * LONG_WINDOW_FACTOR] {
            let reach_s = horizon_s.min(config.reach * window_ms as f64 / 1000.0);
            let mut candidates: Vec<(Option<u32>, Vec<Climb>)> = Vec::new();
            if let Some(climb) = self
                .device
                .as_ref()
                .and_then(|d| d.climb(config, window_ms, now_ms))
            {
                candidates.push((None, vec![climb]));
            }
            let mut climbing: Vec<(u32, Climb)> = self
                .processes
                .iter()
                .filter(|(_, p)| now_ms - p.last_seen_ms <= PROCESS_FRESH_MS)
                .filter_map(|(&(pid, _), p)| Some((pid, p.climb(config, window_ms, now_ms)?)))
                .collect();
            if !climbing.is_empty() {
                climbing.sort_by(|a, b| b.1.rate.total_cmp(&a.1.rate));
                let lead = climbing[0].0;
                candidates.push((Some(lead), climbing.into_iter().map(|(_, c)| c).collect()));
            }
            for (pid, climbs) in candidates {
                let Some(eta_s) = time_to(&climbs, headroom, reach_s) else {
                    continue;
                };
                if best
                    .as_ref()
                    .is_some_and(|b| b.predicted_oom_at_ms <= after(now_ms, eta_s))
                {
                    continue;
                }
                let rate: f64 = climbs.iter().map(|c| c.rate).sum();
                let (lo, hi) = climbs
                    .iter()
                    .fold((0.0, 0.0), |(lo, hi), c| (lo + c.band.0, hi + c.band.1));
                let p_value = climbs.iter().map(|c| c.p_value).fold(0.0, f64::max);
                best = Some(OomPrediction {
                    predicted_oom_at_ms: after(now_ms, eta_s),
                    earliest_ms: after(now_ms, headroom / hi.max(rate)),
                    latest_ms: if lo > 0.0 {
                        after(now_ms, headroom / lo)
                    } else {
                        i64::MAX
                    },
                    growth_bytes_per_s: rate,
                    confidence: 1.0 - p_value,
                    window_ms,
                    risen_bytes: climbs.iter().map(|c| c.risen).sum(),
                    pid,
                });
            }
        }
        best
    }
}

/// Seconds until `climbs` together grow by `headroom`, if within
/// `horizon_s`.
fn time_to(climbs: &[Climb], headroom: f64, horizon_s: f64) -> Option<f64> {
    let growth = |t: f64| climbs.iter().map(|c| c.growth(t)).sum::<f64>();
    if growth(horizon_s) < headroom {
        return None;
    }
    let (mut lo, mut hi) = (0.0, horizon_s);
    for _ in 0..40 {
        let mid = (lo + hi) / 2.0;
        if growth(mid) >= headroom {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

fn after(now_ms: i64, seconds: f64) -> i64 {
    if !seconds.is_finite() || seconds > 1e12 {
        return i64::MAX;
    }
    now_ms.saturating_add((seconds * 1000.0).round() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace_fixtures::{GIB, MIB, jitter};

    const EPOCH: i64 = 1_700_000_000_000;
    const LIMIT: f64 = 80.0 * GIB;

    /// Feeds `minutes` of 1-s samples of the device (and of processes, when
    /// given) and returns the minutes at which an OOM was forecast.
    fn forecast_at(minutes: i64, processes: &[&dyn Fn(f64) -> f64]) -> Vec<f64> {
        let mut p = OomPredictor::new();
        let config = OomConfig::default();
        let mut out = Vec::new();
        for s in 0..minutes * 60 {
            let m = s as f64 / 60.0;
            let ts = EPOCH + s * 1000;
            let mut total = 0.0;
            for (i, f) in processes.iter().enumerate() {
                let v = (f(m) + jitter(i as u64, s, 32.0 * MIB)).max(0.0);
                total += v;
                p.observe_process(100 + i as u32, EPOCH, ts, v as u64);
            }
            let total = total.min(LIMIT);
            p.observe(ts, total as u64);
            if s % 10 == 0
                && p.evaluate(&config, LIMIT as u64, total as u64, ts)
                    .is_some()
            {
                out.push(m);
            }
        }
        out
    }

    #[test]
    fn a_linear_climb_is_forecast_well_ahead() {
        // 1 GiB/min from 30 GiB at minute 20: full at minute 70.
        let f = |m: f64| 30.0 * GIB + GIB * (m - 20.0).max(0.0);
        let at = forecast_at(70, &[&f]);
        let first = at.first().copied().expect("forecast");
        // As soon as the OOM comes within the 30-minute horizon.
        assert!(first <= 41.0, "warned at {first}, OOM at 70");
    }

    #[test]
    fn a_new_neighbour_climbing_is_forecast_from_its_own_climb() {
        let steady = |m: f64| 30.0 * GIB + 3.0 * GIB * (m * 1.3).sin().abs();
        let climber = |m: f64| {
            if m < 30.0 {
                0.0
            } else {
                2.0 * GIB * (m - 30.0)
            }
        };
        let at = forecast_at(50, &[&steady, &climber]);
        let first = at.first().copied().expect("forecast");
        assert!(first <= 40.0, "warned at {first}; full near minute 53");
    }

    #[test]
    fn warm_up_levelling_off_below_the_limit_is_not_forecast() {
        let f = |m: f64| 60.0 * GIB - 55.0 * GIB * (-m / 6.0).exp();
        assert!(forecast_at(90, &[&f]).is_empty());
    }

    #[test]
    fn growth_slowing_towards_a_level_past_the_limit_is_forecast() {
        let f = |m: f64| {
            let t = (m - 20.0).max(0.0);
            120.0 * GIB - 100.0 * GIB * (-t / 40.0).exp()
        };
        assert!(!forecast_at(50, &[&f]).is_empty());
    }

    #[test]
    fn load_coming_back_and_a_single_step_are_not_forecast() {
        let load = |m: f64| {
            40.0 * GIB + 20.0 * GIB * (1.0 - (m / 20.0 * std::f64::consts::TAU).cos()) / 2.0
        };
        let after_first: Vec<f64> = forecast_at(120, &[&load])
            .into_iter()
            .filter(|&m| m > 25.0)
            .collect();
        assert!(after_first.is_empty(), "{after_first:?}");
        let step = |m: f64| if m < 40.0 { 30.0 * GIB } else { 50.0 * GIB };
        assert!(forecast_at(90, &[&step]).is_empty());
    }

    #[test]
    fn a_ramp_that_stopped_under_swings_is_no_longer_forecast() {
        // 1.5 GiB/min from minute 10 to 30, then load swinging ±6 GiB
        // around where it stopped: after the first swing, every peak is
        // as high as the one before, never higher.
        let f = |m: f64| {
            let ramp = 20.0 * GIB + 1.5 * GIB * (m - 10.0).clamp(0.0, 20.0);
            let swing = if m > 30.0 {
                6.0 * GIB * ((m - 30.0) / 4.0 * std::f64::consts::TAU).sin()
            } else {
                0.0
            };
            ramp + swing
        };
        let after: Vec<f64> = forecast_at(120, &[&f])
            .into_iter()
            .filter(|&m| m > 34.0)
            .collect();
        assert!(
            after.is_empty(),
            "forecast after the ramp stopped: {after:?}"
        );
    }

    #[test]
    fn a_young_climb_is_not_extrapolated_past_its_reach() {
        // 1.5 GiB/min from minute 20 to 32, then flat at 38 of 80 GiB: at
        // its end it points at an OOM 28 min away, inside the horizon, but
        // 12 minutes of climb are evidence for 20 (two 10-min windows).
        let f = |m: f64| 20.0 * GIB + 1.5 * GIB * (m - 20.0).clamp(0.0, 12.0);
        assert!(forecast_at(90, &[&f]).is_empty());
    }

    #[test]
    fn at_the_limit_is_forecast_now() {
        let mut p = OomPredictor::new();
        p.observe(EPOCH, LIMIT as u64);
        let f = p.evaluate(&OomConfig::default(), LIMIT as u64, LIMIT as u64, EPOCH);
        assert_eq!(f.map(|f| f.predicted_oom_at_ms), Some(EPOCH));
        assert!(
            p.evaluate(&OomConfig::default(), 0, 5, EPOCH).is_none(),
            "unknown capacity"
        );
    }
}
