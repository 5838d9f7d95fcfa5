//! Samples decoded from chunks (or held in open chunks) folded into a
//! chart's buckets in the collector, so that a chart sends the database a
//! row per bucket rather than every sample it decoded (a week of one GPU at
//! 1 Hz is 600,000 of them), or, where no rollup serves the range, makes
//! the chart's points here without a second trip to the database.

use std::collections::BTreeMap;

use crate::model::{AllocatorReport, GpuSampleRow, ProcessPoint};
use crate::rollup::MINUTE_MS;
use crate::views::{AllocatorPoint, SeriesPoint};

/// The chart bucket `ts_ms` falls in, as the chart query numbers them:
/// `(at - from) / width`, for `at >= from`.
fn bucket(ts_ms: i64, from_ms: i64, width_ms: i64) -> i64 {
    (ts_ms - from_ms).div_euclid(width_ms.max(1))
}

/// A process's allocator reports (rows, chunks and those held open, in any
/// order) folded into a chart's points as they are read, one per bucket:
/// the highest of each figure and the newest report's time. A week of
/// reports at 1 Hz is 600,000 of them; only their times are kept, to count
/// a report found twice once (in rows and a chunk, in a chunk and still held
/// as a flush commits, or joined to intervals that two flushes wrote), but
/// for a chunk read as its minutes ([`AllocatorFold::add_minute`]). The
/// highest of each figure is the same however often a report is added.
///
/// Where the buckets are a minute or wider, reports are folded a minute
/// each first and a minute goes whole to the bucket of its newest report,
/// as a chunk's stored minutes ([`allocator_minutes`]) do: a chart then
/// reads the same from a chunk's reports as from its minutes, before and
/// after compaction. A bucket's edge moves by less than a minute, as
/// charts read from minute rollups do.
pub(crate) struct AllocatorFold {
    from_ms: i64,
    width_ms: i64,
    minutes_first: bool,
    /// By chart bucket, or by minute where `minutes_first`.
    points: BTreeMap<i64, AllocatorPoint>,
    times: Vec<i64>,
}

impl AllocatorFold {
    pub(crate) fn new(from_ms: i64, width_ms: i64) -> Self {
        Self {
            from_ms,
            width_ms,
            minutes_first: width_ms >= MINUTE_MS,
            points: BTreeMap::new(),
            times: Vec::new(),
        }
    }

    fn key(&self, ts_ms: i64) -> i64 {
        if self.minutes_first {
            ts_ms.div_euclid(MINUTE_MS)
        } else {
            bucket(ts_ms, self.from_ms, self.width_ms)
        }
    }

    pub(crate) fn add(&mut self, r: AllocatorReport) {
        self.times.push(r.timestamp_ms);
        let point = AllocatorPoint {
            timestamp_ms: r.timestamp_ms,
            reports: 0,
            allocated_bytes: r.allocated,
            reserved_bytes: r.reserved,
            fragmentation_bytes: r.reserved.saturating_sub(r.allocated),
            inactive_split_bytes: r.inactive_split,
            peak_allocated_bytes: r.peak_allocated,
            alloc_retries: r.alloc_retries,
            ooms: r.ooms,
            weights_bytes: r.weights,
            gradients_bytes: r.gradients,
            optimizer_state_bytes: r.optimizer_state,
        };
        let key = self.key(r.timestamp_ms);
        merge_into(&mut self.points, key, point);
    }

    /// A minute of reports already folded (a chunk's minutes). Its reports
    /// are counted as the minute counted them, beside those added one by
    /// one: a chunk holds each time once, and its minutes are taken only
    /// where it lies wholly inside the chart. Only a chunk of three minutes
    /// or more keeps minutes, so a report held open while its flush commits
    /// (a minute's chunk) is still counted once; one held while a long
    /// replay's flush commits counts twice for that read, with the same
    /// highest figures.
    pub(crate) fn add_minute(&mut self, minute: AllocatorPoint) {
        let key = self.key(minute.timestamp_ms);
        merge_into(&mut self.points, key, minute);
    }

    /// The points in time order, each with how many reports it holds.
    pub(crate) fn points(mut self) -> Vec<AllocatorPoint> {
        self.times.sort_unstable();
        self.times.dedup();
        for t in &self.times {
            let key = self.key(*t);
            if let Some(point) = self.points.get_mut(&key) {
                point.reports += 1;
            }
        }
        if !self.minutes_first {
            return self.points.into_values().collect();
        }
        let mut buckets = BTreeMap::new();
        for minute in self.points.into_values() {
            let key = bucket(minute.timestamp_ms, self.from_ms, self.width_ms);
            merge_into(&mut buckets, key, minute);
        }
        buckets.into_values().collect()
    }
}

/// `add` merged into the point at `key`: the highest of each figure, the
/// newest time, the reports summed.
fn merge_into(points: &mut BTreeMap<i64, AllocatorPoint>, key: i64, add: AllocatorPoint) {
    let Some(point) = points.get_mut(&key) else {
        points.insert(key, add);
        return;
    };
    point.reports += add.reports;
    let most = |held: &mut i64, new: i64| *held = (*held).max(new);
    most(&mut point.timestamp_ms, add.timestamp_ms);
    most(&mut point.allocated_bytes, add.allocated_bytes);
    most(&mut point.reserved_bytes, add.reserved_bytes);
    most(&mut point.fragmentation_bytes, add.fragmentation_bytes);
    most(&mut point.inactive_split_bytes, add.inactive_split_bytes);
    most(&mut point.peak_allocated_bytes, add.peak_allocated_bytes);
    most(&mut point.alloc_retries, add.alloc_retries);
    most(&mut point.ooms, add.ooms);
    // `None < Some`: a part counted once in the bucket shows.
    point.weights_bytes = point.weights_bytes.max(add.weights_bytes);
    point.gradients_bytes = point.gradients_bytes.max(add.gradients_bytes);
    point.optimizer_state_bytes = point.optimizer_state_bytes.max(add.optimizer_state_bytes);
}

/// `reports` (one series, any order) folded a minute each, in time order:
/// what an allocator chunk keeps for charts of minute-wide buckets or
/// wider.
pub(crate) fn allocator_minutes(reports: &[AllocatorReport]) -> Vec<AllocatorPoint> {
    let mut fold = AllocatorFold::new(0, MINUTE_MS);
    reports.iter().for_each(|r| fold.add(*r));
    fold.points()
}

/// Packed process samples as one point per process and bucket, at the
/// bucket's peak: a process chart keeps only the peak.
pub(crate) fn process_peaks(
    samples: Vec<ProcessPoint>,
    from_ms: i64,
    width_ms: i64,
) -> Vec<ProcessPoint> {
    let mut peaks: BTreeMap<(i64, i64), i64> = BTreeMap::new();
    for s in samples {
        let peak = peaks
            .entry((s.process_id, bucket(s.timestamp_ms, from_ms, width_ms)))
            .or_insert(s.used_max);
        *peak = (*peak).max(s.used_max);
    }
    peaks
        .into_iter()
        .map(|((process_id, bucket), used_max)| ProcessPoint {
            process_id,
            timestamp_ms: from_ms + bucket * width_ms.max(1),
            used_last: used_max,
            used_max,
        })
        .collect()
}

/// The packed GPU samples of one bucket as sums and extremes. The chart
/// query reads raw rows and rollups as the same sums (a rollup row counts
/// `samples` samples of its mean), so a bucket comes out the same whether
/// its samples were packed or not. An optional figure is summed over the
/// samples that have it, with their count. Sums are 128-bit: the agent's
/// figures are 64-bit, and a bucket of them must not overflow where
/// Postgres' `numeric` would not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuBucket {
    /// The newest sample's time, which also places the row in its bucket.
    pub newest_ms: i64,
    pub samples: i64,
    pub used_sum: i128,
    pub used_min: i64,
    pub used_max: i64,
    pub reserved: i64,
    pub total: i64,
    pub utilization: Sum,
    pub pcie_tx: Sum,
    pub pcie_rx: Sum,
}

/// A sum over the samples that have a figure, and how many do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Sum {
    pub total: i128,
    pub samples: i64,
}

impl Sum {
    fn add(&mut self, value: Option<i64>) {
        if let Some(value) = value {
            self.total += i128::from(value);
            self.samples += 1;
        }
    }

    /// `None` where no sample had the figure, as SQL's sum of nothing.
    pub fn total(self) -> Option<i128> {
        (self.samples > 0).then_some(self.total)
    }
}

/// Packed GPU samples (of one device) folded into the chart's buckets.
pub(crate) fn gpu_buckets(samples: &[GpuSampleRow], from_ms: i64, width_ms: i64) -> Vec<GpuBucket> {
    let mut buckets: BTreeMap<i64, GpuBucket> = BTreeMap::new();
    for s in samples {
        let into = buckets
            .entry(bucket(s.timestamp_ms, from_ms, width_ms))
            .or_insert_with(|| GpuBucket {
                newest_ms: s.timestamp_ms,
                samples: 0,
                used_sum: 0,
                used_min: s.used_min,
                used_max: s.used_max,
                reserved: s.reserved,
                total: s.total,
                utilization: Sum::default(),
                pcie_tx: Sum::default(),
                pcie_rx: Sum::default(),
            });
        into.newest_ms = into.newest_ms.max(s.timestamp_ms);
        into.samples += 1;
        into.used_min = into.used_min.min(s.used_min);
        into.used_max = into.used_max.max(s.used_max);
        into.reserved = into.reserved.max(s.reserved);
        into.total = into.total.max(s.total);
        into.used_sum += i128::from(s.used_last);
        into.utilization.add(s.utilization_pct.map(i64::from));
        into.pcie_tx.add(s.pcie_tx_bytes_per_s);
        into.pcie_rx.add(s.pcie_rx_bytes_per_s);
    }
    buckets.into_values().collect()
}

/// A chart's points from buckets that hold every sample of theirs (no
/// rollup row shares their range): the chart query's arithmetic on the
/// same sums, done here to spare the database a round trip with a row per
/// bucket (3,600 for an hour at full resolution).
pub(crate) fn series_points(buckets: &[GpuBucket]) -> Vec<SeriesPoint> {
    let mean = |sum: Sum| (sum.samples > 0).then(|| rounded_mean(sum.total, sum.samples));
    buckets
        .iter()
        .filter(|b| b.samples > 0)
        .map(|b| SeriesPoint {
            timestamp_ms: b.newest_ms,
            samples: b.samples,
            memory_used_bytes: rounded_mean(b.used_sum, b.samples),
            memory_used_min_bytes: b.used_min,
            memory_used_max_bytes: b.used_max,
            memory_reserved_bytes: b.reserved,
            memory_total_bytes: b.total,
            utilization_pct: (b.utilization.samples > 0)
                .then(|| b.utilization.total as f64 / b.utilization.samples as f64),
            pcie_tx_bytes_per_s: mean(b.pcie_tx),
            pcie_rx_bytes_per_s: mean(b.pcie_rx),
        })
        .collect()
}

/// `total / samples` rounded half away from zero, as Postgres' `ROUND` of
/// a numeric rounds it.
fn rounded_mean(total: i128, samples: i64) -> i64 {
    let n = i128::from(samples.max(1));
    let (quotient, remainder) = (total / n, total % n);
    let rounded = if 2 * remainder.abs() >= n {
        quotient + total.signum()
    } else {
        quotient
    };
    i64::try_from(rounded).unwrap_or(if rounded < 0 { i64::MIN } else { i64::MAX })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allocator_report_found_twice_counts_once_and_the_peaks_survive() {
        let report = |ts: i64, allocated: i64, weights: Option<i64>| AllocatorReport {
            process_id: 3,
            timestamp_ms: ts,
            allocated,
            reserved: 100,
            active: allocated,
            inactive_split: 1,
            peak_allocated: allocated,
            alloc_retries: ts / 1000,
            ooms: 0,
            weights,
            gradients: None,
            optimizer_state: None,
        };
        let mut folded = AllocatorFold::new(0, 10_000);
        // Held, then the same reports again from a chunk, out of order.
        for r in [report(2_000, 60, None), report(1_000, 40, Some(7))] {
            folded.add(r);
        }
        for r in [
            report(1_000, 40, Some(7)),
            report(2_000, 60, None),
            report(12_000, 50, None),
        ] {
            folded.add(r);
        }
        let points = folded.points();
        assert_eq!(points.len(), 2);
        let first = &points[0];
        assert_eq!((first.timestamp_ms, first.reports), (2_000, 2));
        assert_eq!(first.allocated_bytes, 60);
        assert_eq!(first.fragmentation_bytes, 60, "100 reserved less 40");
        assert_eq!(first.alloc_retries, 2);
        assert_eq!(first.weights_bytes, Some(7), "counted once in the bucket");
        assert_eq!((points[1].timestamp_ms, points[1].reports), (12_000, 1));
        assert_eq!(points[1].weights_bytes, None);
    }

    /// Reports from rows, held ones and chunks' minutes, mixed: a chart of
    /// buckets a minute or wider is the same whichever way each minute came.
    #[test]
    fn a_chart_reads_the_same_from_reports_and_from_their_minutes() {
        let report = |s: i64| AllocatorReport {
            process_id: 3,
            timestamp_ms: 1_764_547_200_000 + s * 1000 + s % 7,
            allocated: 1000 + (s * 7919) % 500,
            reserved: 2000 + (s * 104_729) % 300,
            active: 0,
            inactive_split: s % 13,
            peak_allocated: 1600,
            alloc_retries: s / 1000,
            ooms: 0,
            weights: (s % 30 == 0).then_some(s),
            gradients: None,
            optimizer_state: None,
        };
        let reports: Vec<AllocatorReport> = (0..7200).map(report).collect();
        let from = 1_764_547_200_000 - 12_345;
        for width in [MINUTE_MS, 90_000, 433_000, 3 * 3_600_000] {
            let mut one_by_one = AllocatorFold::new(from, width);
            reports.iter().for_each(|r| one_by_one.add(*r));
            let mut mixed = AllocatorFold::new(from, width);
            let (first_hour, second) = reports.split_at(3600);
            allocator_minutes(first_hour)
                .into_iter()
                .for_each(|m| mixed.add_minute(m));
            second.iter().for_each(|r| mixed.add(*r));
            // The second hour's last minute held open as well: counted once.
            second[3540..].iter().for_each(|r| mixed.add(*r));
            // A late report inside one of the first hour's minutes, read
            // one by one beside them.
            let late = AllocatorReport {
                timestamp_ms: first_hour[600].timestamp_ms + 500,
                allocated: 1_000_000,
                ..first_hour[600]
            };
            one_by_one.add(late);
            mixed.add(late);
            let (expected, got) = (one_by_one.points(), mixed.points());
            assert_eq!(got, expected, "buckets of {width} ms");
            assert_eq!(got.iter().map(|p| p.reports).sum::<i64>(), 7201);
            assert!(got.iter().any(|p| p.allocated_bytes == 1_000_000));
        }
    }

    fn sample(ts: i64, used: i64, util: Option<i16>) -> GpuSampleRow {
        GpuSampleRow {
            device_id: 1,
            timestamp_ms: ts,
            interval_ms: 1000,
            poll_count: 10,
            used_last: used,
            used_min: used - 5,
            used_max: used + 5,
            reserved: used + 100,
            total: 1000,
            utilization_pct: util,
            pcie_tx_bytes_per_s: None,
            pcie_rx_bytes_per_s: Some(7),
        }
    }

    #[test]
    fn gpu_samples_fold_into_sums_per_bucket() {
        let samples = [
            sample(10_000, 100, Some(50)),
            sample(11_000, 300, None),
            sample(12_000, 200, Some(70)),
            sample(20_000, 400, None),
        ];
        let buckets = gpu_buckets(&samples, 10_000, 5_000);
        assert_eq!(buckets.len(), 2);
        let first = &buckets[0];
        assert_eq!((first.newest_ms, first.samples), (12_000, 3));
        assert_eq!(
            (first.used_sum, first.used_min, first.used_max),
            (600, 95, 305)
        );
        assert_eq!((first.reserved, first.total), (400, 1000));
        assert_eq!(
            first.utilization,
            Sum {
                total: 120,
                samples: 2
            },
            "only the samples that have it"
        );
        assert_eq!(first.pcie_tx.total(), None);
        assert_eq!(first.pcie_rx.total(), Some(21));
        assert_eq!(buckets[1].newest_ms, 20_000);
        assert_eq!(buckets[1].utilization.total(), None);
    }

    #[test]
    fn points_are_the_chart_querys_means_rounded_half_away_from_zero() {
        let samples = [
            sample(10_000, 100, Some(50)),
            sample(11_000, 301, None),
            sample(12_000, 200, Some(71)),
            sample(20_000, 400, None),
        ];
        let points = series_points(&gpu_buckets(&samples, 10_000, 5_000));
        assert_eq!(points.len(), 2);
        assert_eq!((points[0].timestamp_ms, points[0].samples), (12_000, 3));
        assert_eq!(points[0].memory_used_bytes, 200, "601 / 3 = 200.33");
        assert_eq!(points[0].utilization_pct, Some(60.5));
        assert_eq!(points[0].pcie_tx_bytes_per_s, None);
        assert_eq!(points[0].pcie_rx_bytes_per_s, Some(7));
        assert_eq!(points[1].utilization_pct, None);
        assert_eq!(rounded_mean(5, 2), 3);
        assert_eq!(rounded_mean(-5, 2), -3);
        assert_eq!(rounded_mean(7, 3), 2);
        assert_eq!(rounded_mean(i128::from(i64::MAX) * 2, 2), i64::MAX);
    }

    #[test]
    fn sums_past_64_bits_stay_exact() {
        let mut huge = sample(0, i64::MAX / 2, None);
        huge.pcie_tx_bytes_per_s = Some(i64::MAX);
        let buckets = gpu_buckets(&[huge, huge], 0, 1000);
        assert_eq!(buckets[0].used_sum, i128::from(i64::MAX / 2) * 2);
        assert_eq!(buckets[0].pcie_tx.total(), Some(i128::from(i64::MAX) * 2));
    }

    #[test]
    fn process_samples_fold_to_their_peak_per_bucket() {
        let point = |process_id, timestamp_ms, used_max| ProcessPoint {
            process_id,
            timestamp_ms,
            used_last: 0,
            used_max,
        };
        let peaks = process_peaks(
            vec![
                point(1, 0, 5),
                point(1, 900, 9),
                point(2, 100, 3),
                point(1, 1000, 1),
            ],
            0,
            1000,
        );
        assert_eq!(
            peaks,
            vec![point(1, 0, 9), point(1, 1000, 1), point(2, 0, 3)]
                .into_iter()
                .map(|p| ProcessPoint {
                    used_last: p.used_max,
                    ..p
                })
                .collect::<Vec<_>>()
        );
    }
}
