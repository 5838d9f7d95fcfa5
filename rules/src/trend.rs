//! Robust trend statistics shared by the memory rules: Theil–Sen fits, the
//! Mann–Kendall trend test and bucket downsampling.
//!
//! Everything here is O(n²) in the number of points, so callers feed it
//! per-bucket extremes (tens of points), never raw samples. Non-finite inputs
//! are dropped rather than propagated: one NaN reading must not silence or
//! trigger a rule.

use std::collections::{BTreeMap, VecDeque};

/// A straight line `y = intercept + slope · x`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    pub slope: f64,
    pub intercept: f64,
}

impl Fit {
    /// The line's value at `x`.
    pub fn at(&self, x: f64) -> f64 {
        self.intercept + self.slope * x
    }
}

/// Theil–Sen estimator: the median of the slopes between every pair of points
/// (pairs with equal `x` skipped), and the median of `y − slope·x` as
/// intercept. Up to ~29 % of the points can be arbitrary outliers without
/// moving the fit, which is why a checkpoint spike does not look like growth.
///
/// Points with a non-finite coordinate are ignored. `None` when fewer than two
/// distinct `x` remain.
pub fn theil_sen(points: &[(f64, f64)]) -> Option<Fit> {
    let points = finite_points(points);
    let mut slopes = pairwise_slopes(&points);
    let slope = median(&mut slopes)?;
    let mut intercepts: Vec<f64> = points
        .iter()
        .map(|&(x, y)| y - slope * x)
        .filter(|v| v.is_finite())
        .collect();
    let intercept = median(&mut intercepts)?;
    Some(Fit { slope, intercept })
}

/// The `lo` and `hi` quantiles (linear interpolation between order
/// statistics) of the pairwise slopes Theil–Sen takes the median of: a
/// distribution-free band around its slope.
///
/// `None` unless `0 ≤ lo ≤ hi ≤ 1` and there are two distinct finite `x`.
pub fn slope_quantiles(points: &[(f64, f64)], lo: f64, hi: f64) -> Option<(f64, f64)> {
    // Written so that NaN bounds fail the check.
    if !(0.0..=1.0).contains(&lo) || !(0.0..=1.0).contains(&hi) || lo > hi {
        return None;
    }
    let points = finite_points(points);
    let mut slopes = pairwise_slopes(&points);
    slopes.sort_by(f64::total_cmp);
    Some((quantile(&slopes, lo)?, quantile(&slopes, hi)?))
}

/// Result of the Mann–Kendall trend test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MannKendall {
    /// Concordant minus discordant pairs: positive for an upward trend.
    pub s: i64,
    /// Continuity-corrected normal score of `s`.
    pub z: f64,
    /// Two-sided p-value of "no monotonic trend".
    pub p_value: f64,
    /// Kendall's tau-a, `s` over the number of pairs, in `[-1, 1]`.
    pub tau: f64,
}

/// Mann–Kendall test on values in time order, with the variance corrected for
/// ties (memory readings repeat exactly when nothing allocates) and the
/// two-sided p-value from the normal approximation.
///
/// Non-finite values are dropped. `None` with fewer than four values left.
/// When every value is tied there is no evidence either way: `s = 0`,
/// `p_value = 1`.
pub fn mann_kendall(values: &[f64]) -> Option<MannKendall> {
    let values: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    let n = values.len();
    if n < 4 {
        return None;
    }
    let mut s: i64 = 0;
    for (i, &a) in values.iter().enumerate() {
        for &b in &values[i + 1..] {
            s += match b.total_cmp(&a) {
                std::cmp::Ordering::Greater => 1,
                std::cmp::Ordering::Less => -1,
                std::cmp::Ordering::Equal => 0,
            };
        }
    }

    let mut sorted = values.clone();
    sorted.sort_by(f64::total_cmp);
    let mut tie_term = 0.0;
    let mut run = 1usize;
    for i in 1..=sorted.len() {
        if i < sorted.len() && sorted[i] == sorted[i - 1] {
            run += 1;
            continue;
        }
        if run > 1 {
            let t = run as f64;
            tie_term += t * (t - 1.0) * (2.0 * t + 5.0);
        }
        run = 1;
    }
    let nf = n as f64;
    let variance = (nf * (nf - 1.0) * (2.0 * nf + 5.0) - tie_term) / 18.0;

    let pairs = nf * (nf - 1.0) / 2.0;
    let tau = s as f64 / pairs;
    if variance <= 0.0 || s == 0 {
        return Some(MannKendall {
            s,
            z: 0.0,
            p_value: 1.0,
            tau,
        });
    }
    let corrected = if s > 0 { s - 1 } else { s + 1 } as f64;
    let z = corrected / variance.sqrt();
    let p_value = erfc(z.abs() / std::f64::consts::SQRT_2).clamp(0.0, 1.0);
    Some(MannKendall { s, z, p_value, tau })
}

/// Complementary error function, Numerical Recipes' Chebyshev fit (`erfcc`):
/// fractional error below 1.2e-7 everywhere, plenty for a p-value threshold
/// and avoids a dependency.
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let ans = t * poly.exp();
    if x >= 0.0 { ans } else { 2.0 - ans }
}

/// One point per `bucket_ms`-wide bucket (aligned on multiples of `bucket_ms`
/// since the epoch): the bucket's smallest value, at the bucket's first
/// timestamp. The floor of a series: a leak raises it, spikes and sawtooth
/// peaks do not. Input need not be sorted; output is in time order. Empty when
/// `bucket_ms ≤ 0`.
pub fn downsample_min(points: &[(i64, u64)], bucket_ms: i64) -> Vec<(i64, u64)> {
    downsample(points, bucket_ms, Extreme::Min)
}

/// Like [`downsample_min`] but keeps each bucket's largest value: the peaks,
/// which are what runs a device out of memory.
pub fn downsample_max(points: &[(i64, u64)], bucket_ms: i64) -> Vec<(i64, u64)> {
    downsample(points, bucket_ms, Extreme::Max)
}

/// Which extreme a bucket keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Extreme {
    Min,
    Max,
}

impl Extreme {
    fn pick(self, a: u64, b: u64) -> u64 {
        match self {
            Extreme::Min => a.min(b),
            Extreme::Max => a.max(b),
        }
    }
}

fn downsample(points: &[(i64, u64)], bucket_ms: i64, extreme: Extreme) -> Vec<(i64, u64)> {
    if bucket_ms <= 0 {
        return Vec::new();
    }
    let mut buckets: BTreeMap<i64, (i64, u64)> = BTreeMap::new();
    for &(ts, value) in points {
        buckets
            .entry(ts.div_euclid(bucket_ms))
            .and_modify(|(first, v)| {
                *first = (*first).min(ts);
                *v = extreme.pick(*v, value);
            })
            .or_insert((ts, value));
    }
    buckets.into_values().collect()
}

/// One bucket of a [`BucketRing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// `ts.div_euclid(bucket_ms)` of its samples.
    pub index: i64,
    /// Its min or max so far.
    pub value: u64,
    /// When `value` was first seen. Placing the extreme at its own time rather
    /// than at the bucket's start keeps a steady climb's max-filtered points
    /// on the true line instead of a bucket ahead of it.
    pub value_ts: i64,
    /// The other extreme: with `value`, how far readings swing within a
    /// bucket.
    pub opposite: u64,
}

/// The hard cap on retained buckets, whatever the configuration says, so that
/// a misconfigured window cannot make a series' memory unbounded. The leak
/// rule's longest window (a day) and its lookback, in minutes, fit; trend
/// fits never see more than a window's few dozen floors, whatever this is.
pub(crate) const MAX_BUCKETS: usize = 3000;

/// Per-bucket extremes of one series, folded in as samples arrive so memory
/// stays bounded by the window rather than the sample rate. Samples at or
/// before the newest timestamp already seen are dropped: agents resend after
/// reconnects and clocks step back.
#[derive(Debug, Clone)]
pub(crate) struct BucketRing {
    bucket_ms: i64,
    capacity: usize,
    extreme: Extreme,
    last: Option<(i64, u64)>,
    buckets: VecDeque<Bucket>,
}

impl BucketRing {
    /// Room for `span_ms` of buckets plus the one being filled.
    pub(crate) fn new(bucket_ms: i64, span_ms: i64, extreme: Extreme) -> Self {
        let bucket_ms = bucket_ms.max(1);
        let span_ms = span_ms.max(0);
        let whole = span_ms / bucket_ms + i64::from(span_ms % bucket_ms != 0);
        let capacity = usize::try_from(whole)
            .unwrap_or(MAX_BUCKETS)
            .saturating_add(1)
            .clamp(2, MAX_BUCKETS);
        Self {
            bucket_ms,
            capacity,
            extreme,
            last: None,
            buckets: VecDeque::with_capacity(capacity),
        }
    }

    /// Folds in one sample; `false` when it was dropped as out of order.
    pub(crate) fn push(&mut self, ts: i64, value: u64) -> bool {
        if self.last.is_some_and(|(last_ts, _)| ts <= last_ts) {
            return false;
        }
        self.last = Some((ts, value));
        let index = ts.div_euclid(self.bucket_ms);
        match self.buckets.back_mut() {
            Some(back) if back.index == index => {
                if self.extreme.pick(back.value, value) != back.value {
                    back.value = value;
                    back.value_ts = ts;
                }
                if self.extreme.pick(back.opposite, value) == back.opposite {
                    back.opposite = value;
                }
            }
            _ => self.buckets.push_back(Bucket {
                index,
                value,
                value_ts: ts,
                opposite: value,
            }),
        }
        // By index, not count, so that a gap in reporting ages old buckets
        // out instead of splicing stale data onto fresh.
        let oldest_kept = index.saturating_sub(self.capacity as i64 - 1);
        while self
            .buckets
            .front()
            .is_some_and(|b| b.index < oldest_kept || self.buckets.len() > self.capacity)
        {
            self.buckets.pop_front();
        }
        true
    }

    #[cfg(test)]
    pub(crate) fn bucket_ms(&self) -> i64 {
        self.bucket_ms
    }

    /// The newest accepted sample.
    pub(crate) fn last(&self) -> Option<(i64, u64)> {
        self.last
    }

    /// Buckets oldest first; the last one may still be filling.
    pub(crate) fn buckets(&self) -> impl Iterator<Item = &Bucket> {
        self.buckets.iter()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Start of a bucket's interval.
    #[cfg(test)]
    pub(crate) fn start_of(&self, bucket: &Bucket) -> i64 {
        bucket.index.saturating_mul(self.bucket_ms)
    }
}

fn finite_points(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect()
}

fn pairwise_slopes(points: &[(f64, f64)]) -> Vec<f64> {
    let mut slopes = Vec::with_capacity(points.len() * points.len().saturating_sub(1) / 2);
    for (i, &(x0, y0)) in points.iter().enumerate() {
        for &(x1, y1) in &points[i + 1..] {
            let dx = x1 - x0;
            if dx == 0.0 {
                continue;
            }
            let slope = (y1 - y0) / dx;
            if slope.is_finite() {
                slopes.push(slope);
            }
        }
    }
    slopes
}

/// Median of finite values (sorts them in place); `None` when empty.
pub(crate) fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    quantile(values, 0.5)
}

/// Quantile of sorted values, interpolating between order statistics (the
/// "type 7" definition of R and numpy).
fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let h = last as f64 * q;
    let below = h.floor();
    let i = (below as usize).min(last);
    let j = (i + 1).min(last);
    let frac = h - below;
    Some(sorted[i] + frac * (sorted[j] - sorted[i]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn theil_sen_recovers_an_exact_line() {
        let points: Vec<(f64, f64)> = (0..20).map(|i| (i as f64, 3.0 + 2.5 * i as f64)).collect();
        let fit = theil_sen(&points).unwrap();
        assert!(close(fit.slope, 2.5, 1e-12));
        assert!(close(fit.intercept, 3.0, 1e-12));
        assert!(close(fit.at(100.0), 253.0, 1e-9));
    }

    #[test]
    fn theil_sen_ignores_a_minority_of_outliers() {
        let mut points: Vec<(f64, f64)> = (0..30).map(|i| (i as f64, 10.0 + i as f64)).collect();
        for i in [3, 11, 19, 27] {
            points[i].1 += 1e6;
        }
        let fit = theil_sen(&points).unwrap();
        assert!(close(fit.slope, 1.0, 1e-9), "{fit:?}");
        assert!(close(fit.intercept, 10.0, 1e-9), "{fit:?}");
    }

    #[test]
    fn theil_sen_skips_equal_x_and_needs_two_distinct_x() {
        assert_eq!(theil_sen(&[]), None);
        assert_eq!(theil_sen(&[(1.0, 1.0)]), None);
        assert_eq!(theil_sen(&[(1.0, 1.0), (1.0, 5.0), (1.0, 9.0)]), None);
        let fit = theil_sen(&[(0.0, 0.0), (0.0, 100.0), (1.0, 1.0), (2.0, 2.0)]).unwrap();
        assert!(fit.slope.is_finite() && fit.intercept.is_finite());
    }

    #[test]
    fn non_finite_points_are_dropped_not_propagated() {
        let points = [
            (0.0, 0.0),
            (1.0, f64::NAN),
            (f64::INFINITY, 1.0),
            (2.0, 2.0),
            (3.0, 3.0),
        ];
        let fit = theil_sen(&points).unwrap();
        assert!(close(fit.slope, 1.0, 1e-12));
        assert_eq!(theil_sen(&[(f64::NAN, 1.0), (f64::NAN, 2.0)]), None);
        let band = slope_quantiles(&points, 0.1, 0.9).unwrap();
        assert!(close(band.0, 1.0, 1e-12) && close(band.1, 1.0, 1e-12));
        let mk = mann_kendall(&[1.0, f64::NAN, 2.0, 3.0, f64::INFINITY, 4.0]).unwrap();
        assert_eq!(mk.s, 6);
        assert_eq!(mann_kendall(&[f64::NAN; 10]), None);
    }

    #[test]
    fn slope_quantiles_bracket_the_median_slope() {
        // Alternating offsets make the pairwise slopes spread out.
        let points: Vec<(f64, f64)> = (0..25)
            .map(|i| {
                (
                    i as f64,
                    2.0 * i as f64 + if i % 2 == 0 { 3.0 } else { -3.0 },
                )
            })
            .collect();
        let fit = theil_sen(&points).unwrap();
        let (lo, hi) = slope_quantiles(&points, 0.1, 0.9).unwrap();
        assert!(lo < fit.slope && fit.slope < hi, "{lo} {} {hi}", fit.slope);
        let (min, max) = slope_quantiles(&points, 0.0, 1.0).unwrap();
        assert!(
            close(min, -4.0, 1e-12) && close(max, 8.0, 1e-12),
            "{min} {max}"
        );
        let (a, b) = slope_quantiles(&points, 0.5, 0.5).unwrap();
        assert!(close(a, fit.slope, 1e-12) && close(b, fit.slope, 1e-12));
    }

    #[test]
    fn slope_quantiles_reject_bad_bounds_and_degenerate_input() {
        let points = [(0.0, 0.0), (1.0, 1.0), (2.0, 2.0)];
        assert_eq!(slope_quantiles(&points, 0.9, 0.1), None);
        assert_eq!(slope_quantiles(&points, -0.1, 0.5), None);
        assert_eq!(slope_quantiles(&points, 0.5, 1.5), None);
        assert_eq!(slope_quantiles(&points, f64::NAN, 0.5), None);
        assert_eq!(slope_quantiles(&[(1.0, 0.0), (1.0, 5.0)], 0.1, 0.9), None);
        assert_eq!(slope_quantiles(&[], 0.1, 0.9), None);
    }

    #[test]
    fn erfc_matches_reference_values() {
        // Reference values from high-precision tables.
        let cases = [
            (0.0, 1.0),
            (0.5, 0.479_500_122_186_953_5),
            (1.0, 0.157_299_207_050_285_1),
            (2.0, 0.004_677_734_981_047_266),
            (3.0, 2.209_049_699_858_544e-5),
            (-1.0, 1.842_700_792_949_715),
        ];
        for (x, want) in cases {
            let got = erfc(x);
            assert!(
                ((got - want) / want).abs() < 1.2e-7,
                "erfc({x}) = {got}, want {want}"
            );
        }
        assert!(erfc(40.0) >= 0.0 && erfc(40.0) < 1e-300);
        assert!(erfc(f64::NAN).is_nan());
    }

    #[test]
    fn mann_kendall_strict_increase() {
        let mk = mann_kendall(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        assert_eq!(mk.s, 10);
        assert!(close(mk.tau, 1.0, 1e-12));
        // var = 5·4·15/18, z = 9/√var.
        let z = 9.0 / (5.0f64 * 4.0 * 15.0 / 18.0).sqrt();
        assert!(close(mk.z, z, 1e-12));
        assert!(close(mk.p_value, 0.027_486, 1e-5), "{}", mk.p_value);
    }

    #[test]
    fn mann_kendall_decrease_is_negative_and_significant() {
        let values: Vec<f64> = (0..30).map(|i| 100.0 - i as f64).collect();
        let mk = mann_kendall(&values).unwrap();
        assert_eq!(mk.s, -435);
        assert!(mk.z < 0.0 && mk.p_value < 1e-6);
        assert!(close(mk.tau, -1.0, 1e-12));
    }

    #[test]
    fn mann_kendall_corrects_variance_for_ties() {
        let values = [1.0, 1.0, 2.0, 2.0, 2.0, 3.0];
        let mk = mann_kendall(&values).unwrap();
        // Pairs across levels only: 2·3 + 2·1 + 3·1.
        assert_eq!(mk.s, 11);
        // n(n−1)(2n+5) = 510; ties: 2·1·9 + 3·2·11 = 84.
        let variance = (510.0 - 84.0) / 18.0;
        assert!(close(mk.z, 10.0 / f64::sqrt(variance), 1e-12), "{mk:?}");
    }

    #[test]
    fn mann_kendall_constant_and_short_series() {
        let mk = mann_kendall(&[7.0; 12]).unwrap();
        assert_eq!(mk.s, 0);
        assert_eq!(mk.p_value, 1.0);
        assert_eq!(mk.z, 0.0);
        assert_eq!(mann_kendall(&[1.0, 2.0, 3.0]), None);
        assert_eq!(mann_kendall(&[]), None);
    }

    #[test]
    fn mann_kendall_alternating_series_has_no_trend() {
        let values: Vec<f64> = (0..40).map(|i| f64::from(i % 2)).collect();
        let mk = mann_kendall(&values).unwrap();
        assert!(mk.p_value > 0.5, "{mk:?}");
    }

    #[test]
    fn downsample_keeps_one_extreme_per_bucket_at_its_first_timestamp() {
        let points = [
            (1_000, 5),
            (1_500, 2),
            (1_999, 9),
            (2_000, 7),
            (2_700, 3),
            (4_100, 8),
        ];
        assert_eq!(
            downsample_min(&points, 1_000),
            vec![(1_000, 2), (2_000, 3), (4_100, 8)]
        );
        assert_eq!(
            downsample_max(&points, 1_000),
            vec![(1_000, 9), (2_000, 7), (4_100, 8)]
        );
    }

    #[test]
    fn downsample_handles_unsorted_negative_and_degenerate_input() {
        let points = [(50, 4), (-10, 1), (-1_000, 6), (10, 2)];
        assert_eq!(
            downsample_min(&points, 100),
            vec![(-1_000, 6), (-10, 1), (10, 2)]
        );
        assert_eq!(
            downsample_max(&points, 100),
            vec![(-1_000, 6), (-10, 1), (10, 4)]
        );
        assert!(downsample_min(&points, 0).is_empty());
        assert!(downsample_max(&points, -5).is_empty());
        assert!(downsample_min(&[], 10).is_empty());
    }

    #[test]
    fn bucket_ring_is_bounded_and_drops_out_of_order_samples() {
        let mut ring = BucketRing::new(1_000, 10_000, Extreme::Min);
        for ts in (0..100_000).step_by(250) {
            assert!(ring.push(ts, 10 + (ts as u64 % 1_000)));
        }
        assert_eq!(ring.len(), 11);
        assert!(ring.buckets().all(|b| b.value == 10));
        assert!(!ring.push(99_750, 0));
        assert!(!ring.push(50_000, 0));
        assert_eq!(ring.last(), Some((99_750, 760)));
        // A long gap ages everything older than the span out.
        assert!(ring.push(1_000_000, 1));
        assert_eq!(ring.len(), 1);
        let first = ring.buckets().next().copied().unwrap();
        assert_eq!(ring.start_of(&first), 1_000_000);
    }

    #[test]
    fn bucket_ring_keeps_maxima_and_caps_absurd_spans() {
        let mut ring = BucketRing::new(10, 30, Extreme::Max);
        for (ts, v) in [(0, 1), (5, 9), (9, 3), (10, 2)] {
            ring.push(ts, v);
        }
        let values: Vec<(u64, u64, i64)> = ring
            .buckets()
            .map(|b| (b.value, b.opposite, b.value_ts))
            .collect();
        assert_eq!(values, vec![(9, 1, 5), (2, 2, 10)]);
        let huge = BucketRing::new(1, i64::MAX, Extreme::Max);
        assert_eq!(huge.capacity, MAX_BUCKETS);
        let tiny = BucketRing::new(0, 0, Extreme::Max);
        assert_eq!(tiny.bucket_ms(), 1);
        assert_eq!(tiny.capacity, 2);
    }
}
