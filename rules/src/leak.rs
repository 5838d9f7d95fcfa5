//! Per-process leak detection, from the definition in docs/rules.md: a leak
//! is memory a process takes and never gives back. It is judged on the
//! process's *floor* (its lower envelope: the least it held in each stretch
//! of time, which spikes, sawtooth peaks and load never raise), and it is a
//! leak when that floor
//!
//! 1. has grown at `min_rate` or faster, by `min_rise` or more, over a
//!    window of `window` or longer (sustained growth, not a step);
//! 2. grew through the whole window: each third at half its pace or more,
//!    the last third at 0.75 of the first's, and the window at 0.75 of the
//!    pace before it (not a step, not a rise that is levelling off);
//! 3. is a monotone trend (Mann–Kendall) standing clear of the floor's own
//!    scatter;
//! 4. is still growing when the alert fires: the least of the window's
//!    last three buckets stands above the least of the three before;
//! 5. is new memory: above every floor the process held in the `lookback`
//!    before the window, so that memory coming back after it was given back
//!    (load, a slow cycle) is not taken for a leak.
//!
//! Windows grow by √2 from `window` to `max_window`, each cut into ten buckets
//! whose minima are the floor. A fast leak is found in the shortest window;
//! a slow one once it has risen by `min_rise`, in the first window long
//! enough for that; a swing of a few minutes disappears into the buckets of
//! the windows an hour and longer. So the time to find a leak scales with
//! its rate, and no shape needs a rule of its own.

use crate::trend::{BucketRing, Extreme, mann_kendall, median, theil_sen};

const MINUTE_MS: i64 = 60_000;
const MIB: f64 = 1024.0 * 1024.0;

/// Buckets a window is cut into: enough for a trend test (Mann–Kendall's p
/// on ten monotone points is 1e-4), few enough that each bucket spans a
/// tenth of the window and so several periods of any swing the window can
/// be fooled by.
const BUCKETS: usize = 10;
/// Fewest buckets with data for a window to be judged.
const MIN_BUCKETS: usize = 8;
/// Each third of the window must grow at this share of the window's pace.
const PART_SHARE: f64 = 0.5;
/// A leak's pace holds; a bounded rise's falls. The window's second half
/// must grow at this share of its first third's pace, and the window at this
/// share of the pace before it. An exponential approach whose time constant
/// is a window shows e^-⅔ = 0.51 between its thirds; a square-root rise
/// judged from a third of a window after its start, 0.65; a steady leak, 1
/// give or take its floor's scatter.
const NOT_SLOWING: f64 = 0.75;
/// The rise must stand this many robust standard deviations of the floor's
/// scatter around its trend.
const RISE_OVER_SCATTER: f64 = 3.0;
/// The least floor of the window's last this many buckets must stand above
/// the least of as many before them…
const RECENT_BUCKETS: usize = 3;
/// …by this share of the window's pace over them, or more.
const STILL_GROWING_SHARE: f64 = 0.5;
/// The newest floor must clear the lookback's highest floor by this share
/// of the window's rise.
const NEW_MEMORY_SHARE: f64 = 0.5;

/// Thresholds of the leak rule.
#[derive(Debug, Clone, PartialEq)]
pub struct LeakConfig {
    /// The shortest window of sustained growth.
    pub window_ms: i64,
    /// The longest window: slow leaks are judged on up to this much history.
    pub max_window_ms: i64,
    /// A process's first minutes are ignored: allocators and caches warm up.
    pub warmup_ms: i64,
    /// Slower growth is not a leak worth an alert.
    pub min_rate_bytes_per_min: f64,
    /// Less growth over the window is not evidence enough.
    pub min_rise_bytes: f64,
    /// Mann–Kendall p-value the floor must reach.
    pub max_p_value: f64,
    /// How far before the window the floor it must exceed is looked for.
    pub lookback_ms: i64,
}

impl Default for LeakConfig {
    fn default() -> Self {
        Self {
            window_ms: 30 * MINUTE_MS,
            max_window_ms: 8 * 60 * MINUTE_MS,
            warmup_ms: 10 * MINUTE_MS,
            min_rate_bytes_per_min: 2.0 * MIB,
            min_rise_bytes: 256.0 * MIB,
            max_p_value: 0.01,
            lookback_ms: 2 * 60 * MINUTE_MS,
        }
    }
}

impl LeakConfig {
    fn is_valid(&self) -> bool {
        self.window_ms >= BUCKETS as i64 * MINUTE_MS
            && self.max_window_ms >= self.window_ms
            && self.warmup_ms >= 0
            && self.lookback_ms >= 0
            && self.min_rate_bytes_per_min.is_finite()
            && self.min_rate_bytes_per_min >= 0.0
            && self.min_rise_bytes.is_finite()
            && self.min_rise_bytes >= 0.0
            && self.max_p_value > 0.0
            && self.max_p_value <= 1.0
    }

    /// The windows judged, shortest first: `window` growing by a factor
    /// of √2 up to `max_window`, each a whole number of minutes per bucket.
    /// The factor keeps a bucket within 1.4× of any swing's period that the
    /// floor must span, at twice the cost of doubling.
    fn windows(&self) -> impl Iterator<Item = i64> + '_ {
        let first = (self.window_ms / MINUTE_MS / BUCKETS as i64).max(1);
        let max = self.max_window_ms / MINUTE_MS / BUCKETS as i64;
        (0..)
            .map(move |k| (first as f64 * std::f64::consts::SQRT_2.powi(k)).round() as i64)
            .take_while(move |&width| width <= max)
            .scan(0, |last, width| {
                let width = width.max(*last + 1);
                *last = width;
                Some(width * BUCKETS as i64 * MINUTE_MS)
            })
            .take_while(move |&w| w <= self.max_window_ms)
    }
}

/// A leak, described over the window that shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct LeakFinding {
    /// Theil–Sen slope of the floor over the window.
    pub rate_bytes_per_min: f64,
    /// Start of the window: the floor has grown at least since.
    pub since_ms: i64,
    /// Length of the window.
    pub window_ms: i64,
    /// The floor at the window's start and now.
    pub floor_from_bytes: f64,
    pub floor_to_bytes: f64,
    /// The floor's pace over the window's last third: still growing.
    pub recent_rate_bytes_per_min: f64,
    /// Mann–Kendall p-value of the floor over the window.
    pub p_value: f64,
}

/// Leak state for one process on one device, fed one sample at a time.
/// Holds one minimum per minute for the longest window and the lookback,
/// never raw samples, and judges once a minute.
#[derive(Debug, Clone)]
pub struct LeakDetector {
    first_seen_ms: i64,
    minutes: BucketRing,
    /// The last judgement and the minute it was made in.
    judged: Option<(i64, Option<LeakFinding>)>,
}

impl LeakDetector {
    /// A detector for a process first seen at `first_seen_ms`, with the
    /// default retention.
    pub fn new(first_seen_ms: i64) -> Self {
        Self::with_config(first_seen_ms, &LeakConfig::default())
    }

    /// A detector retaining what `config`'s longest window and lookback need.
    pub fn with_config(first_seen_ms: i64, config: &LeakConfig) -> Self {
        Self {
            first_seen_ms,
            minutes: BucketRing::new(
                MINUTE_MS,
                config.max_window_ms.saturating_add(config.lookback_ms),
                Extreme::Min,
            ),
            judged: None,
        }
    }

    /// Folds in one reading. Out-of-order and duplicate timestamps are
    /// ignored.
    pub fn observe(&mut self, ts_ms: i64, used_bytes: u64) {
        self.minutes.push(ts_ms, used_bytes);
    }

    /// The leak the floor shows up to the last whole minute, if any: judged
    /// once per minute and remembered in between.
    pub fn evaluate(&mut self, config: &LeakConfig) -> Option<LeakFinding> {
        let (last_ts, _) = self.minutes.last()?;
        let minute = last_ts.div_euclid(MINUTE_MS);
        if let Some((at, finding)) = &self.judged
            && *at == minute
        {
            return finding.clone();
        }
        let finding = if config.is_valid() {
            self.judge(config, minute)
        } else {
            None
        };
        self.judged = Some((minute, finding.clone()));
        finding
    }

    /// Judges the windows ending where minute `current` (still filling)
    /// begins; the smallest that shows a leak describes it.
    fn judge(&self, config: &LeakConfig, current: i64) -> Option<LeakFinding> {
        let whole: Vec<(i64, f64)> = self
            .minutes
            .buckets()
            .filter(|b| b.index < current)
            .map(|b| (b.index, b.value as f64))
            .collect();
        let warm_from = (self.first_seen_ms + config.warmup_ms).div_euclid(MINUTE_MS)
            + i64::from((self.first_seen_ms + config.warmup_ms).rem_euclid(MINUTE_MS) != 0);
        config
            .windows()
            .find_map(|window_ms| judge_window(config, &whole, warm_from, current, window_ms).ok())
    }
}

/// The floor of `[from, from + width·count)` in buckets of `width` minutes:
/// `(bucket number, minimum)` for each bucket with at least half its minutes.
fn floors(minutes: &[(i64, f64)], from: i64, width: i64, count: usize) -> Vec<(usize, f64)> {
    let mut out: Vec<(usize, f64, i64)> = Vec::with_capacity(count);
    let end = from + width * count as i64;
    let start = minutes.partition_point(|&(m, _)| m < from);
    for &(m, v) in &minutes[start..] {
        if m >= end {
            break;
        }
        let bucket = ((m - from) / width) as usize;
        match out.last_mut() {
            Some(last) if last.0 == bucket => {
                last.1 = last.1.min(v);
                last.2 += 1;
            }
            _ => out.push((bucket, v, 1)),
        }
    }
    out.into_iter()
        .filter(|&(_, _, n)| 2 * n >= width)
        .map(|(b, v, _)| (b, v))
        .collect()
}

/// Why a window shows no leak: the first condition it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rejected {
    Warming,
    Sparse,
    TooSlow,
    NotMonotone,
    InScatter,
    NotSustained,
    Slowing,
    NotNewest,
    NotNewMemory,
}

fn judge_window(
    config: &LeakConfig,
    minutes: &[(i64, f64)],
    warm_from: i64,
    end: i64,
    window_ms: i64,
) -> Result<LeakFinding, Rejected> {
    let width = (window_ms / MINUTE_MS / BUCKETS as i64).max(1);
    let span = width * BUCKETS as i64;
    let from = end - span;
    if from < warm_from {
        return Err(Rejected::Warming);
    }
    let floor = floors(minutes, from, width, BUCKETS);
    if floor.len() < MIN_BUCKETS {
        return Err(Rejected::Sparse);
    }
    let width_min = width as f64;
    let points: Vec<(f64, f64)> = floor
        .iter()
        .map(|&(b, v)| ((b as f64 + 0.5) * width_min, v))
        .collect();
    let fit = theil_sen(&points).ok_or(Rejected::Sparse)?;
    let rate = fit.slope;
    let span_min = span as f64;
    let rise = rate * span_min;
    // 1: fast enough, and by enough.
    if rate < config.min_rate_bytes_per_min || rise < config.min_rise_bytes || rise <= 0.0 {
        return Err(Rejected::TooSlow);
    }
    // 3: a monotone trend, clear of the scatter.
    let values: Vec<f64> = points.iter().map(|p| p.1).collect();
    let p_value = mann_kendall(&values).ok_or(Rejected::Sparse)?.p_value;
    if p_value >= config.max_p_value || fit.slope <= 0.0 {
        return Err(Rejected::NotMonotone);
    }
    let mut residuals: Vec<f64> = points.iter().map(|&(x, y)| (y - fit.at(x)).abs()).collect();
    let scatter = 1.4826 * median(&mut residuals).ok_or(Rejected::Sparse)?;
    if rise < RISE_OVER_SCATTER * scatter {
        return Err(Rejected::InScatter);
    }
    // 2: sustained: each third of the window grows at half the window's
    // pace or more (a rise filling two thirds of it and flat for the rest
    // is bounded, not sustained), and the last third at NOT_SLOWING of the
    // first's pace or more (a rise levelling off is bounded too).
    let third = span_min / 3.0;
    let pace = |k: f64| {
        let part: Vec<(f64, f64)> = points
            .iter()
            .copied()
            .filter(|p| p.0 >= k * third && p.0 < (k + 1.0) * third)
            .collect();
        theil_sen(&part).map(|f| f.slope).ok_or(Rejected::Sparse)
    };
    let (early, middle, late) = (pace(0.0)?, pace(1.0)?, pace(2.0)?);
    if early.min(middle).min(late) < PART_SHARE * rate {
        return Err(Rejected::NotSustained);
    }
    if late < NOT_SLOWING * early {
        return Err(Rejected::Slowing);
    }
    // 4: still growing: the least the floor held over the window's last
    // three buckets is above the least of the three before, by half the
    // window's pace or more. Minima over three buckets each, so that a
    // swing slower than one bucket, caught at another phase, is no growth;
    // a rise which stopped some buckets ago is no longer a leak, and a leak
    // that stopped resolves.
    let (newest_x, newest) = *points.last().ok_or(Rejected::Sparse)?;
    if newest_x < span_min - width_min {
        return Err(Rejected::NotNewest);
    }
    let recent = RECENT_BUCKETS as f64 * width_min;
    let least_in = |from: f64, to: f64| {
        points
            .iter()
            .filter(|p| p.0 > from && p.0 <= to)
            .map(|p| p.1)
            .fold(f64::INFINITY, f64::min)
    };
    let (now_least, before_least) = (
        least_in(span_min - recent, span_min),
        least_in(span_min - 2.0 * recent, span_min - recent),
    );
    if !before_least.is_finite() || now_least - before_least < STILL_GROWING_SHARE * rate * recent {
        return Err(Rejected::NotNewest);
    }
    // 2, before the window: a rise slowing down was faster before it.
    let before_from = (from - span).max(warm_from);
    let before_count = ((from - before_from) / width) as usize;
    if before_count >= BUCKETS / 2 {
        let before: Vec<(f64, f64)> = floors(
            minutes,
            from - before_count as i64 * width,
            width,
            before_count,
        )
        .into_iter()
        .map(|(b, v)| ((b as f64 + 0.5) * width_min, v))
        .collect();
        if before.len() >= BUCKETS / 2
            && let Some(prior) = theil_sen(&before)
            && rate < NOT_SLOWING * prior.slope
        {
            return Err(Rejected::Slowing);
        }
    }
    // 5: new memory: above every floor of the lookback before the window.
    let lookback = config.lookback_ms / MINUTE_MS / width;
    if lookback > 0 {
        let back_from = (from - lookback * width).max(warm_from);
        let count = ((from - back_from) / width).max(0) as usize;
        let held = floors(minutes, from - count as i64 * width, width, count)
            .into_iter()
            .map(|(_, v)| v)
            .fold(f64::MIN, f64::max);
        if held > f64::MIN && newest - held < NEW_MEMORY_SHARE * rise {
            return Err(Rejected::NotNewMemory);
        }
    }
    Ok(LeakFinding {
        rate_bytes_per_min: rate,
        since_ms: from * MINUTE_MS,
        window_ms: span * MINUTE_MS,
        floor_from_bytes: fit.at(0.0).max(0.0),
        floor_to_bytes: newest,
        recent_rate_bytes_per_min: late,
        p_value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace_fixtures::{GIB, jitter};

    const EPOCH: i64 = 1_700_000_000_000;

    /// Feeds `minutes` of 2-s samples of `memory(minute)` and returns the
    /// minutes (from the start) at which a leak is found.
    fn found_at(minutes: i64, memory: impl Fn(f64) -> f64) -> Vec<i64> {
        let mut d = LeakDetector::new(EPOCH);
        let config = LeakConfig::default();
        let mut found = Vec::new();
        for s in (0..minutes * 60).step_by(2) {
            let m = s as f64 / 60.0;
            let v = memory(m) + jitter(7, s, 32.0 * MIB);
            d.observe(EPOCH + s * 1000, v.max(0.0) as u64);
            if s % 60 == 0 && d.evaluate(&config).is_some() {
                found.push(s / 60);
            }
        }
        found
    }

    #[test]
    fn a_steady_leak_is_found_after_its_shortest_window() {
        let found = found_at(120, |m| 20.0 * GIB + 30.0 * MIB * m);
        let first = *found.first().expect("found");
        assert!(
            (40..=45).contains(&first),
            "warm-up 10 + window 30: {first}"
        );
        assert!(found.len() > 70, "and stays found while it grows");
    }

    #[test]
    fn a_slow_leak_is_found_once_it_has_risen_enough() {
        let found = found_at(400, |m| 20.0 * GIB + 3.0 * MIB * m);
        let first = *found.first().expect("found");
        // 256 MiB at 3 MiB/min takes 85 min: the 2-hour window shows it.
        assert!((120..=200).contains(&first), "{first}");
    }

    #[test]
    fn a_rise_that_stops_is_no_leak_and_a_leak_that_stops_resolves() {
        assert!(
            found_at(180, |m| 20.0 * GIB
                + 400.0 * MIB * (m - 30.0).clamp(0.0, 20.0))
            .is_empty()
        );
        let found = found_at(200, |m| 20.0 * GIB + 30.0 * MIB * m.min(100.0));
        let last = *found.last().expect("found while it grew");
        // Resolves within three tenths of the windows that still show it.
        assert!(last <= 115, "resolves soon after it stopped: {last}");
    }

    #[test]
    fn swings_around_a_level_are_no_leak_and_rising_troughs_are() {
        let swing = |m: f64| 8.0 * GIB * (m % 7.0) / 7.0;
        assert!(found_at(300, |m| 20.0 * GIB + swing(m)).is_empty());
        let found = found_at(300, |m| 20.0 * GIB + swing(m) + 20.0 * MIB * m);
        assert!(!found.is_empty() && found[0] <= 90, "{found:?}");
    }

    #[test]
    fn memory_coming_back_after_it_was_given_back_is_no_leak() {
        // A slow load cycle: 40-minute climbs, then down again.
        let cycle = |m: f64| {
            let x = (m % 80.0) / 40.0;
            if x < 1.0 { x } else { 2.0 - x }
        };
        let found = found_at(400, |m| 20.0 * GIB + 6.0 * GIB * cycle(m));
        assert!(
            found.iter().all(|&m| m < 90),
            "only the first climb, with no history: {found:?}"
        );
    }

    /// Not a check: `LEAK_TRACE=file.csv LEAK_PID=n cargo test -p
    /// headroom-rules --lib leak::tests::explain -- --ignored --nocapture`
    /// prints, every ten minutes, why each window does or does not show a
    /// leak on that process.
    #[test]
    #[ignore]
    fn explain() {
        let (Ok(path), Ok(pid)) = (std::env::var("LEAK_TRACE"), std::env::var("LEAK_PID")) else {
            return;
        };
        let text = std::fs::read_to_string(path).unwrap();
        let config = LeakConfig::default();
        let mut d: Option<LeakDetector> = None;
        let mut last_minute = i64::MIN;
        let mut t0 = None;
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            if f[3] != pid {
                continue;
            }
            let ts: i64 = f[0].parse().unwrap();
            let used: u64 = f[4].parse().unwrap();
            let t0 = *t0.get_or_insert(ts);
            let d = d.get_or_insert_with(|| LeakDetector::with_config(ts, &config));
            d.observe(ts, used);
            let minute = ts.div_euclid(MINUTE_MS);
            let every: i64 = std::env::var("LEAK_EVERY")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(10);
            if minute != last_minute && (minute - t0 / MINUTE_MS) % every == 0 {
                last_minute = minute;
                let whole: Vec<(i64, f64)> = d
                    .minutes
                    .buckets()
                    .filter(|b| b.index < minute)
                    .map(|b| (b.index, b.value as f64))
                    .collect();
                let warm = (d.first_seen_ms + config.warmup_ms).div_euclid(MINUTE_MS) + 1;
                let verdicts: Vec<String> = config
                    .windows()
                    .map(|w| match judge_window(&config, &whole, warm, minute, w) {
                        Ok(f) => format!(
                            "{}m LEAK {:.1}/min",
                            w / MINUTE_MS,
                            f.rate_bytes_per_min / MIB
                        ),
                        Err(r) => format!("{}m {r:?}", w / MINUTE_MS),
                    })
                    .collect();
                println!(
                    "{:>5} min {:>8.0} MiB  {}",
                    (ts - t0) / MINUTE_MS,
                    used as f64 / MIB,
                    verdicts.join("  ")
                );
            }
        }
    }
}
