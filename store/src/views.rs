//! What the store answers the API with: the JSON shapes of nodes, devices,
//! series, processes, events and allocator reports.

use std::sync::Arc;

use headroom_common::Breakdown;
use serde::Serialize;

/// Processes a series lists at most; the rest of a crowded GPU's processes
/// are left out, smallest first.
pub const MAX_PROCESSES_PER_SERIES: usize = 50;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessSeries {
    pub pid: i64,
    pub start_time_ms: i64,
    pub name: String,
    pub user: String,
    pub slurm_job_id: String,
    pub pod_uid: String,
    pub peak_bytes: i64,
    /// `[bucket end (epoch ms, at most the range's end), highest memory used
    /// in the bucket]`.
    pub points: Vec<(i64, i64)>,
}

#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct EventView {
    pub timestamp_ms: i64,
    /// `xid`, `gpu_lost`, `nvml_hung`, `mig_reconfigured`, …
    pub kind: String,
    pub code: i64,
    pub pid: i64,
    pub detail: String,
}

#[derive(Debug, Clone, Copy)]
pub struct AllocatorSeriesQuery<'a> {
    pub device_uuid: &'a str,
    pub pid: i64,
    pub start_time_ms: Option<i64>,
    pub from_ms: i64,
    pub to_ms: i64,
    pub max_points: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocatorSeries {
    pub device_uuid: String,
    pub pid: i64,
    pub start_time_ms: i64,
    pub points: Vec<AllocatorPoint>,
}

/// One bucket of a process's allocator reports: the highest value of each
/// counter in the bucket, so a burst of fragmentation between two points is
/// not averaged away.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct AllocatorPoint {
    pub timestamp_ms: i64,
    pub reports: i64,
    pub allocated_bytes: i64,
    pub reserved_bytes: i64,
    /// Reserved but not allocated: held by the process, usable by no one.
    pub fragmentation_bytes: i64,
    pub inactive_split_bytes: i64,
    pub peak_allocated_bytes: i64,
    /// Cumulative since the process started.
    pub alloc_retries: i64,
    pub ooms: i64,
    /// The client's counts (the highest in the bucket); `None` where it
    /// did not count them.
    pub weights_bytes: Option<i64>,
    pub gradients_bytes: Option<i64>,
    pub optimizer_state_bytes: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct NodeView {
    pub name: String,
    pub boot_id: String,
    pub agent_version: String,
    pub driver_version: String,
    pub sample_interval_ms: i64,
    pub registered_at_ms: i64,
    pub last_seen_ms: i64,
    pub gpu_count: i64,
    pub mig_instance_count: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceView {
    // Shared strings: the overview's views at 100,000 GPUs are made anew
    // each second from the same names, and a clone of an `Arc` is a count.
    pub uuid: Arc<str>,
    pub node: Arc<str>,
    /// `gpu` or `mig`.
    pub kind: &'static str,
    pub parent_uuid: Option<Arc<str>>,
    pub index: i64,
    pub name: Arc<str>,
    pub mig_profile: Option<Arc<str>>,
    pub mig_gpu_instance_id: Option<i64>,
    pub mig_compute_instance_id: Option<i64>,
    pub memory_total_bytes: i64,
    /// `None` until the first sample arrives.
    pub latest: Option<LatestSample>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LatestSample {
    pub timestamp_ms: i64,
    pub memory_used_bytes: i64,
    pub memory_used_min_bytes: i64,
    pub memory_used_max_bytes: i64,
    pub memory_reserved_bytes: i64,
    pub memory_total_bytes: i64,
    /// Free memory now: total − used − reserved.
    pub headroom_bytes: i64,
    pub headroom_pct: f64,
    /// Free memory at the interval's peak.
    pub peak_headroom_bytes: i64,
    pub utilization_pct: Option<i64>,
    pub pcie_tx_bytes_per_s: Option<i64>,
    pub pcie_rx_bytes_per_s: Option<i64>,
}

impl LatestSample {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        timestamp_ms: i64,
        used: i64,
        used_min: i64,
        used_max: i64,
        reserved: i64,
        total: i64,
        utilization_pct: Option<i64>,
        pcie_tx_bytes_per_s: Option<i64>,
        pcie_rx_bytes_per_s: Option<i64>,
    ) -> Self {
        let headroom = (total - used - reserved).max(0);
        let headroom_pct = if total > 0 {
            (headroom as f64 * 1000.0 / total as f64).round() / 10.0
        } else {
            0.0
        };
        Self {
            timestamp_ms,
            memory_used_bytes: used,
            memory_used_min_bytes: used_min,
            memory_used_max_bytes: used_max,
            memory_reserved_bytes: reserved,
            memory_total_bytes: total,
            headroom_bytes: headroom,
            headroom_pct,
            peak_headroom_bytes: (total - used_max - reserved).max(0),
            utilization_pct,
            pcie_tx_bytes_per_s,
            pcie_rx_bytes_per_s,
        }
    }

    /// Whether memory in use at the interval's peak, with what is reserved,
    /// reached 90 % of the total: what the fleet history counts as a GPU
    /// below 10 % headroom.
    pub fn low_headroom_at_peak(&self) -> bool {
        self.memory_total_bytes > 0
            && (self.memory_used_max_bytes + self.memory_reserved_bytes) * 10
                >= self.memory_total_bytes * LOW_HEADROOM_USED_TENTHS
    }
}

/// One bucket of a device's series. With one sample per bucket, `memory_used`
/// is that sample's last value; with more, it is their mean, while min and
/// max keep the extremes of every poll in the bucket.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SeriesPoint {
    pub timestamp_ms: i64,
    pub samples: i64,
    pub memory_used_bytes: i64,
    pub memory_used_min_bytes: i64,
    pub memory_used_max_bytes: i64,
    pub memory_reserved_bytes: i64,
    pub memory_total_bytes: i64,
    pub utilization_pct: Option<f64>,
    pub pcie_tx_bytes_per_s: Option<i64>,
    pub pcie_rx_bytes_per_s: Option<i64>,
}

/// The physical GPUs whose memory, in use or reserved, reached this share
/// of their total (in tenths) count as below 10 % headroom.
pub(crate) const LOW_HEADROOM_USED_TENTHS: i64 = 9;

/// One bucket of the whole fleet's history, from the fleet rollups
/// (`fleet_1m`, `fleet_1h`): one row per minute or hour summed over the
/// fleet's physical GPUs. A MIG instance's memory is part of its parent
/// GPU's, so instances add nothing to the sums. Where a bucket holds several
/// rollup rows, the sums are their mean (`used_bytes`) or their highest (the
/// rest), so a chart of a week reads one row per minute rather than one per
/// GPU and minute.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FleetHistoryPoint {
    /// The bucket's last millisecond, at most the range's end: the same
    /// stamp as a process series' points, and at most one sample interval
    /// after a device series' point for the same bucket.
    pub timestamp_ms: i64,
    /// The sum over GPUs of each one's mean memory used, averaged over the
    /// bucket.
    pub used_bytes: i64,
    /// The sum over GPUs of each one's highest memory used in a minute (an
    /// hour, on ranges read from hours), the highest such sum in the bucket:
    /// an upper bound on what the fleet used at any one moment.
    pub used_max_bytes: i64,
    /// The sum of the reporting GPUs' memory totals (highest in the bucket).
    pub capacity_bytes: i64,
    /// Physical GPUs with data, the most in any one minute (hour) of the
    /// bucket. 0 in a bucket that holds only alerts (no rollup yet): its
    /// memory figures are 0 too and mean "no data".
    pub devices: i64,
    /// Physical GPUs whose peak (used max + reserved) reached 90 % of their
    /// total in a minute (hour), themselves or through one of their MIG
    /// instances (a job on a full instance runs out of memory however much
    /// the rest of the GPU has free), each counted once; the most in any
    /// one minute (hour) of the bucket.
    pub devices_below_10pct: i64,
    /// Alerts whose `fired_at_ms` falls in the bucket.
    pub alerts_fired: i64,
}

/// One fleet rollup row's figures folded into a chart bucket, as both
/// backends read them; `bucket` numbers the bucket from the range's start.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct FleetBucketRow {
    pub bucket: i64,
    pub used_bytes: i64,
    pub used_max_bytes: i64,
    pub capacity_bytes: i64,
    pub devices: i64,
    pub devices_below_10pct: i64,
}

/// Alerts fired in one chart bucket.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct AlertBucketRow {
    pub bucket: i64,
    pub fired: i64,
}

/// Joins the rollups' buckets and the alerts' into points in time order,
/// each stamped with its bucket's last millisecond (at most `to_ms`).
pub(crate) fn fleet_points(
    rollups: Vec<FleetBucketRow>,
    alerts: Vec<AlertBucketRow>,
    from_ms: i64,
    to_ms: i64,
    width_ms: i64,
) -> Vec<FleetHistoryPoint> {
    let stamp = |bucket: i64| {
        from_ms
            .saturating_add(bucket.saturating_add(1).saturating_mul(width_ms))
            .saturating_sub(1)
            .min(to_ms)
    };
    let mut points: std::collections::BTreeMap<i64, FleetHistoryPoint> = rollups
        .into_iter()
        .map(|r| {
            (
                r.bucket,
                FleetHistoryPoint {
                    timestamp_ms: stamp(r.bucket),
                    used_bytes: r.used_bytes,
                    used_max_bytes: r.used_max_bytes,
                    capacity_bytes: r.capacity_bytes,
                    devices: r.devices,
                    devices_below_10pct: r.devices_below_10pct,
                    alerts_fired: 0,
                },
            )
        })
        .collect();
    for a in alerts {
        points
            .entry(a.bucket)
            .or_insert_with(|| FleetHistoryPoint {
                timestamp_ms: stamp(a.bucket),
                used_bytes: 0,
                used_max_bytes: 0,
                capacity_bytes: 0,
                devices: 0,
                devices_below_10pct: 0,
                alerts_fired: 0,
            })
            .alerts_fired += a.fired;
    }
    points.into_values().collect()
}

/// Whose processes [`crate::Store::processes`] lists.
#[derive(Debug, Clone, Copy)]
pub enum ProcessesOn<'a> {
    /// Every node's.
    Fleet,
    /// One node's.
    Node(&'a str),
    /// Those on these devices, by uuid; a process on a MIG instance is on
    /// the instance, not its GPU.
    Devices(&'a [String]),
    /// Every node's whose owner matches: the dashboard's user, job and pod
    /// filters, answered without sending the fleet's processes (200,000 at
    /// 100,000 GPUs) to be filtered in the browser.
    Owners(OwnerMatch<'a>),
}

/// Parts of a process's owner, each matched as a case-sensitive substring
/// (as the dashboard's filters match); an empty part matches every process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OwnerMatch<'a> {
    pub user: &'a str,
    pub slurm_job_id: &'a str,
    pub pod_uid: &'a str,
}

impl OwnerMatch<'_> {
    /// Whether no part is asked for, so that every process matches.
    pub fn is_any(&self) -> bool {
        self.user.is_empty() && self.slurm_job_id.is_empty() && self.pod_uid.is_empty()
    }

    /// The same test as the stores' SQL, for processes already read.
    pub fn matches(&self, process: &ProcessView) -> bool {
        process.user.contains(self.user)
            && process.slurm_job_id.contains(self.slurm_job_id)
            && process.pod_uid.contains(self.pod_uid)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessView {
    pub node: String,
    pub device_uuid: String,
    pub gpu_index: i64,
    pub pid: i64,
    pub start_time_ms: i64,
    pub name: String,
    pub uid: i64,
    pub user: String,
    pub container_id: String,
    pub container_runtime: String,
    pub pod_uid: String,
    pub pod_qos_class: String,
    pub slurm_job_id: String,
    pub memory_used_bytes: i64,
    pub memory_peak_bytes: i64,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
    /// The newest report of the process's own allocator; `None` for a
    /// process that does not report (most do not).
    pub allocator: Option<AllocatorLatest>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocatorLatest {
    pub timestamp_ms: i64,
    pub allocated_bytes: i64,
    pub reserved_bytes: i64,
    pub fragmentation_bytes: i64,
    /// Fragmentation as a share of what the allocator holds, 0 to 1.
    pub fragmentation_ratio: f64,
    pub inactive_split_bytes: i64,
    pub peak_allocated_bytes: i64,
    pub alloc_retries: i64,
    pub ooms: i64,
    /// Where the process's memory goes at its peak, when its client counts
    /// its weights, gradients and optimizer state; `None` otherwise.
    pub breakdown: Option<Breakdown>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fleet_points_join_rollups_and_alerts_stamped_with_their_bucket_end() {
        let row = |bucket, devices| FleetBucketRow {
            bucket,
            used_bytes: 10,
            used_max_bytes: 20,
            capacity_bytes: 100,
            devices,
            devices_below_10pct: 1,
        };
        let alerts = vec![
            AlertBucketRow {
                bucket: 1,
                fired: 2,
            },
            AlertBucketRow {
                bucket: 3,
                fired: 1,
            },
        ];
        // Buckets of 100 ms from 1,000; the range ends inside bucket 3.
        let points = fleet_points(vec![row(0, 4), row(1, 5)], alerts, 1000, 1349, 100);
        let stamps: Vec<(i64, i64, i64)> = points
            .iter()
            .map(|p| (p.timestamp_ms, p.devices, p.alerts_fired))
            .collect();
        assert_eq!(
            stamps,
            vec![(1099, 4, 0), (1199, 5, 2), (1349, 0, 1)],
            "an alerts-only bucket has no devices; the last ends with the range"
        );
        assert_eq!(points[2].capacity_bytes, 0);
    }

    #[test]
    fn headroom_excludes_used_and_reserved() {
        let s = LatestSample::new(0, 60, 50, 70, 10, 100, None, None, None);
        assert_eq!(s.headroom_bytes, 30);
        assert_eq!(s.peak_headroom_bytes, 20);
        assert!((s.headroom_pct - 30.0).abs() < 1e-9);
    }
}
