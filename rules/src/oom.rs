//! Time-to-OOM prediction for a device (GPU or MIG instance) or a process.
//!
//! A naive linear extrapolation of the last few minutes warns on every
//! allocator warm-up, every evaluation loop and every checkpoint spike. This
//! one works on the upper envelope of max-filtered buckets (only new peaks
//! count as growth) and demands agreement: the whole window and its recent
//! half must both project OOM within the horizon, the raw peaks must trend up
//! significantly, the most recent quarter, on its own, must project OOM
//! within the horizon too, and the last half minute must still be climbing.
//! A climb back to a level held earlier in the lookback (load that comes and
//! goes) and a climb that clearly slows down towards a plateau below the
//! limit are not forecast. A climb with no settled past (a job that has just
//! started, a GPU that was idle) is forecast only while it climbs steadily:
//! warm-ups slow down and load's first swing speeds up, a march to OOM
//! from a standing start does neither. A climb in steps, flat between them,
//! is forecast from its steps over a longer span.

use crate::trend::{
    Bucket, BucketRing, Extreme, downsample_max, mann_kendall, median, slope_quantiles, theil_sen,
};

/// Mann–Kendall p-value the window's peaks must reach.
const MAX_P_VALUE: f64 = 0.05;
/// Quantiles of the pairwise slopes taken as the slow and fast rates.
const BAND: (f64, f64) = (0.1, 0.9);
/// How many typical within-bucket swings below the peak the newest reading
/// must fall to count as memory released.
const RELEASE_SWINGS: f64 = 2.0;
/// Fewest points in any segment that gets its own fit.
const MIN_SEGMENT_POINTS: usize = 4;
/// Quantiles of a half's pairwise slopes taken as its slow and fast pace
/// when judging whether a climb levels off.
const SLOWDOWN_BAND: (f64, f64) = (0.25, 0.75);
/// Windows of minute peaks a staircase is looked for in.
const STAIRCASE_WINDOWS: i64 = 3;
/// Fewest separate runs of new highs that make a staircase.
const MIN_STEPS: usize = 3;
/// A step rises more than this many typical within-minute swings...
const STEP_SWINGS: f64 = 4.0;
/// ...and more than this share of the limit.
const MIN_STEP_SHARE_OF_LIMIT: f64 = 0.01;
/// The last step is at most this many typical spacings old.
const STEP_SPACINGS_LATE: f64 = 1.5;
/// Width of the lookback's buckets.
const HISTORY_BUCKET_MS: i64 = 60_000;
/// Below this share of the limit a device holds no job's memory (an idle
/// GPU shows the driver's few hundred MiB).
const IDLE_SHARE_OF_LIMIT: f64 = 0.05;
/// The newest readings must still climb over at least this many seconds...
const STILL_CLIMBING_S: f64 = 30.0;
/// ...or as long as the latest pace takes to add this many typical swings...
const STILL_CLIMBING_SWINGS: f64 = 2.0;
/// ...by at least this share of what the latest pace adds over that span.
const STILL_CLIMBING_SHARE: f64 = 0.5;
/// Windows of memory held above idle before the current window that make a
/// past a climb stands on.
const SETTLE_WINDOWS: i64 = 2;
/// A climb without a settled past is forecast only when its pace in each
/// third of the window, and of its minutes since memory was last idle, is
/// at least this share of the fastest third's.
const YOUNG_STEADY_RATIO: f64 = 0.9;
/// Fewest points whose thirds give three paces.
const STEADY_MIN_POINTS: usize = 4;

/// Thresholds of the time-to-OOM rule.
#[derive(Debug, Clone, PartialEq)]
pub struct OomConfig {
    /// The evidence window.
    pub window_ms: i64,
    /// No prediction before this much data has been seen in the window.
    pub min_history_ms: i64,
    /// Width of the max-filter buckets.
    pub bucket_ms: i64,
    /// Warn when OOM is predicted sooner than this.
    pub horizon_ms: i64,
    /// How far back a level memory already held counts: a climb back to it
    /// (load that comes and goes, a periodic evaluation) is not a march to
    /// OOM. Longer remembers slower cycles, and delays the warning of a real
    /// climb that starts below an old spike until it passes that spike.
    pub lookback_ms: i64,
}

impl Default for OomConfig {
    fn default() -> Self {
        Self {
            window_ms: 10 * 60_000,
            min_history_ms: 5 * 60_000,
            bucket_ms: 10_000,
            horizon_ms: 30 * 60_000,
            lookback_ms: 120 * 60_000,
        }
    }
}

impl OomConfig {
    fn is_valid(&self) -> bool {
        self.window_ms > 0
            && self.bucket_ms > 0
            && self.horizon_ms > 0
            && self.min_history_ms >= 0
            && self.lookback_ms >= 0
    }
}

/// An OOM expected within the horizon.
#[derive(Debug, Clone, PartialEq)]
pub struct OomPrediction {
    /// Central estimate: the current level extended at the window's
    /// Theil–Sen rate.
    pub predicted_oom_at_ms: i64,
    /// At the fast end of the slope band (90th percentile pairwise slope).
    pub earliest_ms: i64,
    /// At the slow end (10th percentile); `i64::MAX` when that slope is not
    /// positive, i.e. the data are also consistent with no OOM at all.
    pub latest_ms: i64,
    /// Theil–Sen growth rate of the peaks over the window.
    pub growth_bytes_per_s: f64,
    /// One minus the Mann–Kendall p-value of the peaks over the window: how
    /// unlikely so steady a climb would be if memory were not trending up.
    /// It rates the trend, not the predicted time, and is 1 when the limit is
    /// already reached.
    pub confidence: f64,
}

/// Time-to-OOM state for one series, fed one sample at a time. Holds
/// per-bucket maxima for one window, never raw samples.
#[derive(Debug, Clone)]
pub struct OomPredictor {
    ring: BucketRing,
    /// Minute maxima over the lookback: the levels memory already held.
    history: BucketRing,
}

impl Default for OomPredictor {
    fn default() -> Self {
        Self::new()
    }
}

impl OomPredictor {
    /// A predictor retaining buckets for [`OomConfig::default`]. Use
    /// [`OomPredictor::with_config`] when evaluating with a longer window:
    /// evidence older than the retained window is gone, so such a predictor
    /// would never see enough history.
    pub fn new() -> Self {
        Self::with_config(&OomConfig::default())
    }

    /// A predictor whose buckets and retention follow `config`.
    pub fn with_config(config: &OomConfig) -> Self {
        Self {
            ring: BucketRing::new(config.bucket_ms, config.window_ms, Extreme::Max),
            history: BucketRing::new(HISTORY_BUCKET_MS, config.lookback_ms, Extreme::Max),
        }
    }

    /// Folds in one reading. Out-of-order and duplicate timestamps are
    /// ignored.
    pub fn observe(&mut self, ts_ms: i64, used_bytes: u64) {
        self.ring.push(ts_ms, used_bytes);
        self.history.push(ts_ms, used_bytes);
    }

    /// `limit_bytes` = total − reserved (what can be allocated); `now_ms` the
    /// evaluation time. `Some` only when OOM is predicted within the horizon,
    /// or the newest reading is already at the limit.
    pub fn evaluate(
        &self,
        config: &OomConfig,
        limit_bytes: u64,
        now_ms: i64,
    ) -> Option<OomPrediction> {
        // A zero limit means the capacity is unknown, not that it is full.
        if !config.is_valid() || limit_bytes == 0 {
            return None;
        }
        self.trend(config, limit_bytes, now_ms)
            .or_else(|| self.staircase(config, limit_bytes, now_ms))
    }

    /// A steady climb over the window, from its 10 s peaks.
    fn trend(&self, config: &OomConfig, limit_bytes: u64, now_ms: i64) -> Option<OomPrediction> {
        let window_start = now_ms.saturating_sub(config.window_ms);
        let (last_ts, last_used) = self.ring.last()?;
        if last_used >= limit_bytes && last_ts >= window_start {
            return Some(OomPrediction {
                predicted_oom_at_ms: now_ms,
                earliest_ms: now_ms,
                latest_ms: now_ms,
                growth_bytes_per_s: 0.0,
                confidence: 1.0,
            });
        }

        let bucket_ms = self.ring.bucket_ms();
        let newest_index = last_ts.div_euclid(bucket_ms);
        // The newest bucket can still receive samples until it ends, so its
        // maximum is understated; older ones are final because late samples
        // are dropped.
        let buckets: Vec<&Bucket> = self
            .ring
            .buckets()
            .filter(|b| {
                let start = self.ring.start_of(b);
                let done = b.index != newest_index || start.saturating_add(bucket_ms) <= now_ms;
                done && start >= window_start && start < now_ms
            })
            .collect();
        let complete: Vec<(i64, u64)> = buckets.iter().map(|b| (b.value_ts, b.value)).collect();
        let covered_ms = (complete.len() as f64) * (bucket_ms as f64);
        if covered_ms < config.min_history_ms as f64 {
            return None;
        }
        let series = downsample_max(&complete, config.bucket_ms);
        if series.len() < 2 * MIN_SEGMENT_POINTS {
            return None;
        }

        // Seconds relative to now, so the fits' intercepts are levels now.
        let peaks: Vec<(f64, f64)> = series
            .iter()
            .map(|&(ts, v)| ((ts - now_ms) as f64 / 1000.0, v as f64))
            .collect();
        let values: Vec<f64> = peaks.iter().map(|&(_, y)| y).collect();
        let mk = mann_kendall(&values)?;
        if mk.s <= 0 || mk.p_value > MAX_P_VALUE {
            return None;
        }

        // Only new highs count: an eval loop or a checkpoint that frees its
        // memory again shows up in the raw peaks as a climb, but its envelope
        // goes flat once the first cycle's peak is in the window.
        let mut high = f64::NEG_INFINITY;
        let envelope: Vec<(f64, f64)> = peaks
            .iter()
            .map(|&(x, y)| {
                high = high.max(y);
                (x, high)
            })
            .collect();
        let n = envelope.len();
        let whole = theil_sen(&envelope)?;
        let recent = theil_sen(&envelope[n / 2..])?;
        let latest = theil_sen(&envelope[n - (n / 4).max(MIN_SEGMENT_POINTS)..])?;
        if !(whole.slope > 0.0 && recent.slope > 0.0 && latest.slope > 0.0) {
            return None;
        }
        let mut swings: Vec<f64> = buckets
            .iter()
            .map(|b| b.value.abs_diff(b.opposite) as f64)
            .collect();
        let swing = median(&mut swings)?;
        // Still climbing: over the newest half minute (longer for a climb
        // slow against the noise, up to the latest quarter) the envelope
        // has to rise by a fair share of what the latest pace adds. A climb
        // that has just stopped (an evaluation's memory in place, load that
        // has reached its level) still leaves a steep slope in every part of
        // the window for minutes, and only the newest readings tell.
        let latest_from = envelope[n - (n / 4).max(MIN_SEGMENT_POINTS)].0;
        let (last_x, peak) = *envelope.last()?;
        let span_s = (STILL_CLIMBING_SWINGS * swing / latest.slope)
            .min(last_x - latest_from)
            .max(STILL_CLIMBING_S);
        let before = envelope
            .iter()
            .rev()
            .find(|&&(x, _)| x <= last_x - span_s)
            .map(|&(_, y)| y)?;
        if peak - before < STILL_CLIMBING_SHARE * latest.slope * span_s {
            return None;
        }

        // Memory given back since the peak, by more than readings normally
        // swing within a bucket, means the climb was a cycle (an eval loop
        // whose period is about the minimum history), not a march to OOM.
        if peak - last_used as f64 > RELEASE_SWINGS * swing {
            return None;
        }

        // A level memory held before this window, within the lookback, and
        // came down from: the climb goes back to where it has been (a KV
        // cache following load, the next evaluation), not into new
        // territory. Warn once it passes that level, not before.
        let prior_high = self
            .history
            .buckets()
            .filter(|b| self.history.start_of(b).saturating_add(HISTORY_BUCKET_MS) <= window_start)
            .map(|b| b.value)
            .max();
        if prior_high.is_some_and(|high| high as f64 + RELEASE_SWINGS * swing >= peak) {
            return None;
        }

        let limit = limit_bytes as f64;
        let level_now = recent.at(0.0);
        let remaining = limit - level_now;
        let settled = self.settled(config, limit, window_start);
        // A climb with no settled past (a job starting on an idle GPU, a
        // new series) is a warm-up or the first swing of load until it has
        // shown otherwise: it is forecast only while it climbs steadily.
        // Warm-ups slow down and a load's first swing speeds up then slows
        // down; a real march to OOM from a standing start goes at its pace.
        if !settled {
            let climb = self.climb_since_idle(limit, now_ms);
            let since = climb.first().map_or(f64::INFINITY, |p| p.0);
            let recent_part: Vec<(f64, f64)> =
                envelope.iter().copied().filter(|p| p.0 >= since).collect();
            // A climb younger than a few minutes lies wholly in the window's
            // finer peaks.
            let climb_steady = climb.len() < STEADY_MIN_POINTS || steady(&climb);
            if !(climb_steady && steady(&recent_part)) {
                return None;
            }
        }
        // Growth that slows down levels off: with the older half climbing
        // faster than the recent one, a rate decaying exponentially at the
        // pace the halves show adds `rate × τ` more, and a plateau below the
        // limit is no OOM. A steady climb (the halves alike) gets τ far
        // beyond the horizon and is forecast as before; an accelerating one
        // is never held back.
        if remaining_rise(&envelope, latest.slope).is_some_and(|rise| level_now + rise < limit) {
            return None;
        }
        let horizon_s = config.horizon_ms as f64 / 1000.0;
        let (slow, fast) = slope_quantiles(&envelope, BAND.0, BAND.1)?;
        let confidence = (1.0 - mk.p_value).clamp(0.0, 1.0);
        if remaining <= 0.0 {
            return Some(OomPrediction {
                predicted_oom_at_ms: now_ms,
                earliest_ms: now_ms,
                latest_ms: now_ms,
                growth_bytes_per_s: whole.slope,
                confidence,
            });
        }
        let whole_s = remaining / whole.slope;
        let recent_s = remaining / recent.slope;
        // The last quarter has to agree as well: a warm-up that has reached
        // its plateau still has a steep recent half, but its last quarter
        // only climbs by the odd jitter record.
        let latest_s = remaining / latest.slope;
        if !(whole_s <= horizon_s && recent_s <= horizon_s && latest_s <= horizon_s) {
            return None;
        }
        let latest_ms = if slow > 0.0 {
            after(now_ms, remaining / slow)
        } else {
            i64::MAX
        };
        Some(OomPrediction {
            predicted_oom_at_ms: after(now_ms, whole_s),
            earliest_ms: after(now_ms, remaining / fast),
            latest_ms,
            growth_bytes_per_s: whole.slope,
            confidence,
        })
    }
}

impl OomPredictor {
    /// Whether memory was held (above idle) through the `SETTLE_WINDOWS`
    /// windows before `window_start`: a past the current climb stands on.
    fn settled(&self, config: &OomConfig, limit: f64, window_start: i64) -> bool {
        let span = config.window_ms.saturating_mul(SETTLE_WINDOWS);
        let since = window_start.saturating_sub(span);
        let needed = (span / HISTORY_BUCKET_MS).max(1) - 1;
        let held = self
            .history
            .buckets()
            .filter(|b| {
                let start = self.history.start_of(b);
                start >= since && start.saturating_add(HISTORY_BUCKET_MS) <= window_start
            })
            .filter(|b| b.value as f64 >= IDLE_SHARE_OF_LIMIT * limit)
            .count();
        held as i64 >= needed
    }

    /// Minute peaks, as a running maximum, since memory last stood idle (or
    /// the series began), with times in seconds relative to `now_ms`.
    fn climb_since_idle(&self, limit: f64, now_ms: i64) -> Vec<(f64, f64)> {
        let Some((last_ts, _)) = self.history.last() else {
            return Vec::new();
        };
        let newest_index = last_ts.div_euclid(HISTORY_BUCKET_MS);
        let mut climb: Vec<(f64, f64)> = Vec::new();
        let mut expected_index = None;
        for b in self.history.buckets().filter(|b| b.index != newest_index) {
            let held = b.value as f64 >= IDLE_SHARE_OF_LIMIT * limit;
            // A gap in reporting breaks the climb as idle memory does.
            if !held || expected_index.is_some_and(|i| i != b.index) {
                climb.clear();
            }
            expected_index = Some(b.index + 1);
            if held {
                climb.push(((b.value_ts - now_ms) as f64 / 1000.0, b.value as f64));
            }
        }
        let mut high = f64::NEG_INFINITY;
        for point in &mut climb {
            high = high.max(point.1);
            point.1 = high;
        }
        climb
    }

    /// A climb in steps (a job that grabs another block every few minutes),
    /// which the trend misses: between two steps the last quarter of the
    /// window is flat. Over `STAIRCASE_WINDOWS` windows of minute peaks, the
    /// new highs must come in at least `MIN_STEPS` separate runs, the last
    /// no longer ago than one and a half typical spacings (still climbing),
    /// each higher than the noise and a hundredth of the limit; the pace is
    /// the rise of the later runs over the time they took. A warm-up or a
    /// ramp is one run, a single step or a spike one as well, and a level
    /// held before (load, the next spike) makes no new high.
    fn staircase(
        &self,
        config: &OomConfig,
        limit_bytes: u64,
        now_ms: i64,
    ) -> Option<OomPrediction> {
        let span_start = now_ms.saturating_sub(config.window_ms.saturating_mul(STAIRCASE_WINDOWS));
        let (last_ts, last_used) = self.history.last()?;
        let newest_index = last_ts.div_euclid(HISTORY_BUCKET_MS);
        let minutes: Vec<&Bucket> = self
            .history
            .buckets()
            .filter(|b| b.index != newest_index && self.history.start_of(b) >= span_start)
            .collect();
        // The whole span, so that a new series cannot pass a warm-up off as
        // steps.
        let span_minutes =
            (config.window_ms.saturating_mul(STAIRCASE_WINDOWS) / HISTORY_BUCKET_MS) as usize;
        if minutes.len() + 1 < span_minutes {
            return None;
        }
        let prior_high = self
            .history
            .buckets()
            .filter(|b| self.history.start_of(b) < span_start)
            .map(|b| b.value)
            .max()
            .unwrap_or(0);
        let mut swings: Vec<f64> = minutes
            .iter()
            .map(|b| b.value.abs_diff(b.opposite) as f64)
            .collect();
        let swing = median(&mut swings)?;
        let limit = limit_bytes as f64;
        let min_step = (STEP_SWINGS * swing).max(limit * MIN_STEP_SHARE_OF_LIMIT);

        // Runs of consecutive minutes that set a new high by more than a
        // step: (when the run ended, how much it added).
        let mut high = prior_high as f64;
        let mut runs: Vec<(i64, f64)> = Vec::new();
        let mut previous_rose = false;
        for b in &minutes {
            let value = b.value as f64;
            let rose = value - high > min_step;
            if rose {
                match runs.last_mut() {
                    Some(run) if previous_rose => {
                        run.0 = b.value_ts;
                        run.1 += value - high;
                    }
                    _ => runs.push((b.value_ts, value - high)),
                }
            }
            high = high.max(value);
            previous_rose = rose;
        }
        if runs.len() < MIN_STEPS {
            return None;
        }
        let mut spacings: Vec<f64> = runs.windows(2).map(|w| (w[1].0 - w[0].0) as f64).collect();
        let spacing = median(&mut spacings)?;
        let (last_run_ts, _) = *runs.last()?;
        if (last_ts - last_run_ts) as f64 > STEP_SPACINGS_LATE * spacing {
            return None;
        }
        // Memory given back since the top is not a staircase any more.
        if high - last_used as f64 > STEP_SWINGS * swing {
            return None;
        }
        let (first_run_ts, _) = runs[0];
        let added: f64 = runs[1..].iter().map(|r| r.1).sum();
        let took_s = (last_run_ts - first_run_ts) as f64 / 1000.0;
        if !(took_s > 0.0 && added > 0.0) {
            return None;
        }
        let rate = added / took_s;
        let remaining = limit - high;
        let horizon_s = config.horizon_ms as f64 / 1000.0;
        let to_oom_s = remaining.max(0.0) / rate;
        if to_oom_s > horizon_s {
            return None;
        }
        // The fastest and slowest pace between two runs give the range.
        let paces: Vec<f64> = runs
            .windows(2)
            .map(|w| w[1].1 / ((w[1].0 - w[0].0).max(1) as f64 / 1000.0))
            .collect();
        let fast = paces.iter().copied().fold(rate, f64::max);
        let slow = paces.iter().copied().fold(rate, f64::min);
        let values: Vec<f64> = minutes.iter().map(|b| b.value as f64).collect();
        let confidence = mann_kendall(&values).map_or(0.0, |mk| (1.0 - mk.p_value).clamp(0.0, 1.0));
        Some(OomPrediction {
            predicted_oom_at_ms: after(now_ms, to_oom_s),
            earliest_ms: after(now_ms, remaining.max(0.0) / fast),
            latest_ms: after(now_ms, remaining.max(0.0) / slow),
            growth_bytes_per_s: rate,
            confidence,
        })
    }
}

/// Whether each third of `envelope` climbs at a pace within
/// [`YOUNG_STEADY_RATIO`] of the fastest third's.
fn steady(envelope: &[(f64, f64)]) -> bool {
    let n = envelope.len();
    if n < STEADY_MIN_POINTS {
        return false;
    }
    let edges = [0, n / 3, 2 * n / 3, n - 1].map(|i| envelope[i]);
    let paces: Vec<f64> = edges
        .windows(2)
        .map(|w| (w[1].1 - w[0].1) / (w[1].0 - w[0].0))
        .collect();
    let fastest = paces.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let slowest = paces.iter().copied().fold(f64::INFINITY, f64::min);
    fastest.is_finite() && fastest > 0.0 && slowest >= YOUNG_STEADY_RATIO * fastest
}

/// How much more a decelerating climb adds before it levels off, when the
/// older half of `envelope` climbs faster than the recent half; `None` when
/// it does not slow down.
fn remaining_rise(envelope: &[(f64, f64)], rate_now: f64) -> Option<f64> {
    let n = envelope.len();
    let (older, recent) = envelope.split_at(n / 2);
    // Noise alone makes the halves' rates differ, which a long horizon
    // would turn into a plateau: the older half is taken at the slow end of
    // its pairwise slopes and the recent half at the fast end, so only a
    // slowdown larger than the noise counts.
    let (older_rate, _) = slope_quantiles(older, SLOWDOWN_BAND.0, SLOWDOWN_BAND.1)?;
    let (_, recent_rate) = slope_quantiles(recent, SLOWDOWN_BAND.0, SLOWDOWN_BAND.1)?;
    if !(older_rate > 0.0 && recent_rate > 0.0 && recent_rate < older_rate) {
        return None;
    }
    let centre = |part: &[(f64, f64)]| {
        (part.first().map_or(0.0, |p| p.0) + part.last().map_or(0.0, |p| p.0)) / 2.0
    };
    let apart_s = centre(recent) - centre(older);
    let decay = (older_rate / recent_rate).ln();
    if !(apart_s > 0.0 && decay > 0.0) {
        return None;
    }
    let tau_s = apart_s / decay;
    Some(rate_now.max(0.0) * tau_s)
}

/// `now_ms` plus `seconds`, saturating at `i64::MAX` (never OOM, in effect).
fn after(now_ms: i64, seconds: f64) -> i64 {
    let ms = (seconds * 1000.0).round();
    if !ms.is_finite() || ms >= (i64::MAX - now_ms.max(0)) as f64 {
        return i64::MAX;
    }
    now_ms.saturating_add((ms as i64).max(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace_fixtures::{GIB, MIB, bytes, jitter};

    const EPOCH: i64 = 1_700_000_000_000;

    /// Feeds `trace(t_s)` once a second for `duration_s` (stopping at the
    /// limit, as the process would die there) and evaluates every `every_s`
    /// with `now` = the sample just observed, as ingest does. Returns
    /// `(t_s, prediction)` with times relative to the start.
    fn run(
        config: &OomConfig,
        limit: f64,
        duration_s: i64,
        every_s: i64,
        trace: impl Fn(i64) -> f64,
    ) -> Vec<(i64, Option<OomPrediction>)> {
        let mut predictor = OomPredictor::with_config(config);
        let mut out = Vec::new();
        for t in 0..=duration_s {
            let now = EPOCH + t * 1000;
            predictor.observe(now, bytes(trace(t)));
            if t % every_s == 0 {
                let p = predictor.evaluate(config, bytes(limit), now).map(|mut p| {
                    p.predicted_oom_at_ms -= EPOCH;
                    p.earliest_ms -= EPOCH;
                    if p.latest_ms != i64::MAX {
                        p.latest_ms -= EPOCH;
                    }
                    p
                });
                out.push((t, p));
            }
        }
        out
    }

    /// No forecast holds for `for_s` running, as the rule's default `for`
    /// demands before it warns.
    fn assert_never_held(results: &[(i64, Option<OomPrediction>)], for_s: i64) {
        let mut since = None;
        for (t, p) in results {
            since = match (p, since) {
                (Some(_), None) => Some(*t),
                (Some(_), held) => held,
                (None, _) => None,
            };
            if let Some(start) = since {
                assert!(t - start < for_s, "a forecast held from {start} s to {t} s");
            }
        }
    }

    fn assert_quiet(results: &[(i64, Option<OomPrediction>)]) {
        let warned: Vec<_> = results.iter().filter(|(_, p)| p.is_some()).collect();
        assert!(warned.is_empty(), "unexpected warnings: {warned:?}");
    }

    /// Every evaluation from `from_s` until shortly before the limit is hit
    /// warns, within `tolerance` of the true time to OOM.
    fn assert_predicts(
        results: &[(i64, Option<OomPrediction>)],
        from_s: i64,
        until_s: i64,
        oom_at_s: f64,
        tolerance: f64,
    ) {
        let checked: Vec<_> = results
            .iter()
            .filter(|(t, _)| (from_s..=until_s).contains(t))
            .collect();
        assert!(!checked.is_empty());
        for (t, p) in checked {
            let p = p
                .as_ref()
                .unwrap_or_else(|| panic!("no prediction at t = {t} s"));
            let predicted_s = p.predicted_oom_at_ms as f64 / 1000.0;
            let error = (predicted_s - oom_at_s).abs() / (oom_at_s - *t as f64);
            assert!(
                error <= tolerance,
                "at t = {t} s predicted OOM at {predicted_s:.0} s, truth {oom_at_s:.0} s"
            );
            assert!(
                p.earliest_ms <= p.predicted_oom_at_ms && p.predicted_oom_at_ms <= p.latest_ms,
                "{p:?}"
            );
            assert!(p.confidence > 0.95 && p.confidence <= 1.0, "{p:?}");
            assert!(p.growth_bytes_per_s > 0.0);
        }
    }

    #[test]
    fn predicts_a_linear_ramp() {
        // 4 GiB/min from 60 GiB fills 80 GiB in five minutes, so the
        // evidence has to be shorter than the defaults'.
        let config = OomConfig {
            window_ms: 180_000,
            min_history_ms: 90_000,
            ..OomConfig::default()
        };
        let rate = 4.0 * GIB / 60.0;
        let results = run(&config, 80.0 * GIB, 299, 10, |t| {
            60.0 * GIB + rate * t as f64
        });
        assert_quiet(&results[..9]);
        assert_predicts(&results, 100, 270, 300.0, 0.15);
    }

    #[test]
    fn predicts_a_ramp_with_default_config() {
        let config = OomConfig::default();
        let rate = 2.0 * GIB / 60.0;
        let results = run(&config, 80.0 * GIB, 899, 10, |t| {
            50.0 * GIB + rate * t as f64 + jitter(1, t, 128.0 * MIB)
        });
        assert_quiet(&results[..30]);
        assert_predicts(&results, 310, 870, 900.0, 0.15);
    }

    #[test]
    fn a_slow_leak_warns_only_within_a_long_horizon() {
        // 64 MiB/min from 50 GiB fills 80 GiB in 8 hours.
        let rate = 64.0 * MIB / 60.0;
        let trace = |t: i64| 50.0 * GIB + rate * t as f64 + jitter(2, t, 32.0 * MIB);
        let short = OomConfig::default();
        assert_quiet(&run(&short, 80.0 * GIB, 3600, 10, trace));
        let long = OomConfig {
            horizon_ms: 10 * 3600 * 1000,
            ..OomConfig::default()
        };
        let results = run(&long, 80.0 * GIB, 3600, 10, trace);
        let oom_at_s = 30.0 * GIB / rate;
        // A new series this slow and noisy is not steady enough, minute to
        // minute, to be told from a warm-up: it is forecast once it has a
        // settled past.
        assert_predicts(&results, 1800, 3600, oom_at_s, 0.15);
    }

    #[test]
    fn warmup_plateau_never_warns_after_min_history() {
        let config = OomConfig::default();
        for (seed, amplitude) in [(0, 0.0), (4, 64.0 * MIB)] {
            let results = run(&config, 80.0 * GIB, 3600, 10, |t| {
                let x = (t as f64 / 240.0).min(1.0);
                2.0 * GIB + 69.0 * GIB * (1.0 - (1.0 - x) * (1.0 - x)) + jitter(seed, t, amplitude)
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn a_new_job_whose_climb_slows_down_never_warns() {
        let config = OomConfig::default();
        // Warm-ups whose pace falls linearly to zero (the hardest to tell
        // from a ramp: nearly straight at first), towards 50-67 GiB of 80.
        for (minutes, plateau) in [(10.0, 50.0), (20.0, 60.0), (30.0, 67.0), (40.0, 60.0)] {
            let results = run(&config, 80.0 * GIB, 3600, 10, |t| {
                let x = (t as f64 / 60.0 / minutes).min(1.0);
                5.0 * GIB
                    + (plateau - 5.0) * GIB * (1.0 - (1.0 - x) * (1.0 - x))
                    + jitter(11, t, 128.0 * MIB)
            });
            // The slowest ease-out is nearly straight for its first minutes:
            // a forecast may flicker, but never for as long as `for`.
            assert_never_held(&results, 30);
        }
    }

    #[test]
    fn the_first_swing_of_load_never_warns() {
        let config = OomConfig::default();
        // From a trough, with no history of coming back down: speeds up,
        // then slows down.
        for period_min in [16.0, 20.0, 30.0, 45.0] {
            let results = run(&config, 80.0 * GIB, 3600, 10, |t| {
                let phase = std::f64::consts::TAU * t as f64 / 60.0 / period_min;
                50.0 * GIB - 10.0 * GIB * phase.cos() + jitter(12, t, 128.0 * MIB)
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn a_job_on_an_idle_gpu_is_judged_by_its_own_climb() {
        let config = OomConfig::default();
        let idle = 300.0 * MIB;
        // Idle for 30 min, then a job climbing 2.5 GiB/min from 10 GiB: OOM
        // 28 min after it starts.
        let rate = 2.5 * GIB / 60.0;
        let results = run(&config, 80.0 * GIB, 3400, 10, |t| {
            if t < 1800 {
                idle
            } else {
                10.0 * GIB + rate * (t - 1800) as f64
            }
        });
        let oom_at_s = 1800.0 + 70.0 * GIB / rate;
        assert_predicts(&results, 1800 + 600, 3300, oom_at_s, 0.15);
        // The same idle GPU, then a warm-up easing out at 60 GiB.
        let results = run(&config, 80.0 * GIB, 5400, 10, |t| {
            if t < 1800 {
                return idle;
            }
            let x = ((t - 1800) as f64 / 1200.0).min(1.0);
            5.0 * GIB + 55.0 * GIB * (1.0 - (1.0 - x) * (1.0 - x))
        });
        assert_quiet(&results);
    }

    #[test]
    fn a_climb_that_has_stopped_is_not_forecast() {
        let config = OomConfig::default();
        // 40 min at 50 GiB, then 10 GiB more over 2 min, held: the climb is
        // steep in every part of the window for minutes after it stops.
        let results = run(&config, 80.0 * GIB, 3600, 2, |t| {
            let climb = ((t - 2400) as f64 / 120.0).clamp(0.0, 1.0);
            50.0 * GIB + 10.0 * GIB * climb + jitter(13, t, 64.0 * MIB)
        });
        let after_stop: Vec<_> = results
            .iter()
            .filter(|(t, _)| *t >= 2400 + 120 + 60)
            .collect();
        assert!(
            after_stop.iter().all(|(_, p)| p.is_none()),
            "{after_stop:?}"
        );
    }

    #[test]
    fn a_staircase_to_oom_warns_between_its_steps() {
        let config = OomConfig::default();
        // 4 GiB every 5 min from 30 GiB: 80 GiB at 62.5 min.
        let steps = |t: i64| 30.0 * GIB + 4.0 * GIB * (t / 300) as f64 + jitter(5, t, 64.0 * MIB);
        let results = run(&config, 80.0 * GIB, 3300, 10, steps);
        let warned: Vec<i64> = results
            .iter()
            .filter(|(_, p)| p.is_some())
            .map(|(t, _)| *t)
            .collect();
        let first = *warned.first().expect("a staircase towards the limit warns");
        assert!(first <= 40 * 60, "first warning at {first} s");
        // Between steps the window's last quarter is flat: only the
        // staircase path sees it, and it keeps warning until the end.
        assert!(warned.iter().any(|t| t % 300 > 150), "{warned:?}");
        assert!(results.last().unwrap().1.is_some());
    }

    #[test]
    fn a_slow_staircase_far_from_the_limit_stays_quiet() {
        let config = OomConfig::default();
        let steps = |t: i64| 30.0 * GIB + 0.5 * GIB * (t / 300) as f64 + jitter(6, t, 64.0 * MIB);
        assert_quiet(&run(&config, 80.0 * GIB, 7200, 10, steps));
    }

    #[test]
    fn sawtooth_never_warns() {
        let config = OomConfig::default();
        // Periods shorter than the minimum history, and about as long: the
        // first cycle of those is a ramp until memory is released.
        for (period_s, offset_s) in [(120, 0), (180, 40), (296, 4), (300, 0), (300, 150)] {
            let results = run(&config, 80.0 * GIB, 3600, 10, |t| {
                let phase = ((t + offset_s) % period_s) as f64 / period_s as f64;
                40.0 * GIB + 30.0 * GIB * phase + jitter(6, t, 64.0 * MIB)
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn checkpoint_spikes_never_warn() {
        let config = OomConfig::default();
        for offset_s in [0, 333] {
            let results = run(&config, 80.0 * GIB, 3 * 3600, 10, |t| {
                let t = t + offset_s;
                let base = 55.0 * GIB + jitter(8, t, 64.0 * MIB);
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
    fn a_single_step_up_never_warns() {
        let config = OomConfig::default();
        for (seed, amplitude) in [(0, 0.0), (9, 64.0 * MIB), (10, 256.0 * MIB)] {
            let results = run(&config, 80.0 * GIB, 3600, 10, |t| {
                let step = if t >= 1200 { 8.0 * GIB } else { 0.0 };
                60.0 * GIB + step + jitter(seed, t, amplitude)
            });
            assert_quiet(&results);
        }
    }

    #[test]
    fn no_prediction_before_min_history() {
        let config = OomConfig::default();
        let rate = 4.0 * GIB / 60.0;
        let results = run(&config, 80.0 * GIB, 290, 1, |t| {
            20.0 * GIB + rate * t as f64
        });
        assert_quiet(&results);
    }

    #[test]
    fn out_of_order_samples_are_ignored() {
        let config = OomConfig::default();
        let rate = 2.0 * GIB / 60.0;
        let mut clean = OomPredictor::new();
        let mut noisy = OomPredictor::new();
        for t in 0..600 {
            let ts = EPOCH + t * 1000;
            let used = bytes(50.0 * GIB + rate * t as f64);
            clean.observe(ts, used);
            noisy.observe(ts, used);
            // Late resends would otherwise raise old buckets' peaks.
            noisy.observe(ts - 30_000, bytes(79.0 * GIB));
            noisy.observe(ts, bytes(79.0 * GIB));
        }
        let now = EPOCH + 599_000;
        let limit = bytes(80.0 * GIB);
        let expected = clean.evaluate(&config, limit, now);
        assert!(expected.is_some());
        assert_eq!(noisy.evaluate(&config, limit, now), expected);
    }

    #[test]
    fn at_the_limit_is_predicted_now() {
        let config = OomConfig::default();
        let mut predictor = OomPredictor::new();
        predictor.observe(EPOCH, bytes(80.0 * GIB));
        let p = predictor
            .evaluate(&config, bytes(80.0 * GIB), EPOCH + 1000)
            .unwrap();
        assert_eq!(p.predicted_oom_at_ms, EPOCH + 1000);
        assert_eq!(p.earliest_ms, EPOCH + 1000);
        assert_eq!(p.latest_ms, EPOCH + 1000);
        assert_eq!(p.confidence, 1.0);
        // A reading older than the window says nothing about now.
        assert_eq!(
            predictor.evaluate(&config, bytes(80.0 * GIB), EPOCH + 3_600_000),
            None
        );
    }

    #[test]
    fn degenerate_inputs_predict_nothing() {
        let config = OomConfig::default();
        let empty = OomPredictor::default();
        assert_eq!(empty.evaluate(&config, 1 << 30, EPOCH), None);
        let mut predictor = OomPredictor::new();
        let rate = 4.0 * GIB / 60.0;
        for t in 0..600 {
            predictor.observe(EPOCH + t * 1000, bytes(20.0 * GIB + rate * t as f64));
        }
        let now = EPOCH + 599_000;
        assert!(
            predictor
                .evaluate(&config, bytes(80.0 * GIB), now)
                .is_some()
        );
        assert_eq!(predictor.evaluate(&config, 0, now), None);
        for broken in [
            OomConfig {
                window_ms: 0,
                ..OomConfig::default()
            },
            OomConfig {
                bucket_ms: 0,
                ..OomConfig::default()
            },
            OomConfig {
                horizon_ms: 0,
                ..OomConfig::default()
            },
            OomConfig {
                min_history_ms: -1,
                ..OomConfig::default()
            },
        ] {
            assert_eq!(
                predictor.evaluate(&broken, bytes(80.0 * GIB), now),
                None,
                "{broken:?}"
            );
        }
    }

    #[test]
    fn history_stays_bounded() {
        let config = OomConfig::default();
        let mut predictor = OomPredictor::new();
        for t in 0..3 * 3600 {
            predictor.observe(EPOCH + t * 1000, 1 << 30);
        }
        assert!(predictor.ring.len() <= (config.window_ms / config.bucket_ms) as usize + 1);
    }

    #[test]
    fn simulated_ramp_to_oom_warns_and_warmup_does_not() {
        let scenario = headroom_sim::Scenario::from_toml_str(
            r#"
            [[node]]
            name = "n1"
            [[node.gpu]]
            model = "NVIDIA H100 80GB HBM3"
            memory_total = "80GiB"
            reserved = "512MiB"
            [[node.gpu.process]]
            pid = 1
            name = "ramp"
            memory = { shape = "ramp_to_oom", start = "10GiB", rate_per_min = "3GiB" }
            [[node.gpu]]
            model = "NVIDIA H100 80GB HBM3"
            memory_total = "80GiB"
            reserved = "512MiB"
            [[node.gpu.process]]
            pid = 2
            name = "warm"
            memory = { shape = "warmup_plateau", start = "2GiB", plateau = "71GiB", warmup_s = 240, jitter = "64MiB" }
            "#,
        )
        .unwrap();
        let node = &scenario.nodes()[0];
        let config = OomConfig::default();
        let mut predictors = [OomPredictor::new(), OomPredictor::new()];
        let mut warned = [Vec::new(), Vec::new()];
        for t in 0..1800 {
            let now = EPOCH + t * 1000;
            for (i, gpu) in node.state_at(t as f64).iter().enumerate() {
                predictors[i].observe(now, gpu.memory_used);
                if t % 10 == 0 {
                    let limit = gpu.memory_total - gpu.memory_reserved;
                    if predictors[i].evaluate(&config, limit, now).is_some() {
                        warned[i].push(t);
                    }
                }
            }
        }
        assert!(!warned[0].is_empty());
        assert!(warned[1].is_empty(), "{:?}", warned[1]);
    }
}
