//! What the store answers the API with: the JSON shapes of nodes, devices,
//! series, processes, events and allocator reports.

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
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
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
    pub uuid: String,
    pub node: String,
    /// `gpu` or `mig`.
    pub kind: &'static str,
    pub parent_uuid: Option<String>,
    pub index: i64,
    pub name: String,
    pub mig_profile: Option<String>,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_excludes_used_and_reserved() {
        let s = LatestSample::new(0, 60, 50, 70, 10, 100, None, None, None);
        assert_eq!(s.headroom_bytes, 30);
        assert_eq!(s.peak_headroom_bytes, 20);
        assert!((s.headroom_pct - 30.0).abs() < 1e-9);
    }
}
