//! Row shapes both backends read with the same SQL columns, and their
//! conversion into the API's views.

use std::collections::HashMap;

use headroom_common::composition::AllocatorFigures;
use headroom_common::{Breakdown, Composition, Dtype, Part};

use crate::model::{DeviceMeta, GpuSampleRow, NodeSession};
use crate::views::{
    AllocatorLatest, DeviceView, LatestSample, MAX_PROCESSES_PER_SERIES, ProcessSeries, ProcessView,
};

/// One bucket of one process, as both backends read it.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ProcessBucket {
    pub process_id: i64,
    pub timestamp_ms: i64,
    pub used: i64,
}

/// A process that held memory on a device within a range.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ProcessMeta {
    pub id: i64,
    pub pid: i64,
    pub start_time_ms: i64,
    pub name: String,
    pub user: String,
    pub slurm_job_id: String,
    pub pod_uid: String,
}

/// Puts each process's buckets under it, biggest peak first.
pub(crate) fn process_series_from(
    meta: Vec<ProcessMeta>,
    buckets: Vec<ProcessBucket>,
) -> Vec<ProcessSeries> {
    let mut points: HashMap<i64, Vec<(i64, i64)>> = HashMap::new();
    for b in buckets {
        points
            .entry(b.process_id)
            .or_default()
            .push((b.timestamp_ms, b.used));
    }
    let mut series: Vec<ProcessSeries> = meta
        .into_iter()
        .filter_map(|m| {
            let mut pts = points.remove(&m.id)?;
            pts.sort_unstable();
            Some(ProcessSeries {
                pid: m.pid,
                start_time_ms: m.start_time_ms,
                name: m.name,
                user: m.user,
                slurm_job_id: m.slurm_job_id,
                pod_uid: m.pod_uid,
                peak_bytes: pts.iter().map(|(_, v)| *v).max().unwrap_or(0),
                points: pts,
            })
        })
        .collect();
    series.sort_by(|a, b| b.peak_bytes.cmp(&a.peak_bytes).then(a.pid.cmp(&b.pid)));
    series.truncate(MAX_PROCESSES_PER_SERIES);
    series
}

/// The process's id in the store, for series queries.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ProcessKey {
    pub id: i64,
    pub start_time_ms: i64,
}

/// Width of the buckets that fold `[from_ms, to_ms]` into at most `max_points`.
pub(crate) fn bucket_width_ms(from_ms: i64, to_ms: i64, max_points: u32) -> i64 {
    // Both ends are included: the range holds `to − from + 1` milliseconds.
    let span = to_ms.saturating_sub(from_ms).saturating_add(1).max(1);
    let points = i64::from(max_points.max(1));
    ((span + points - 1) / points).max(1)
}

/// A process row as both backends read it.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ProcessRow {
    pub(crate) node: String,
    pub(crate) device_uuid: String,
    pub(crate) gpu_index: i64,
    pub(crate) pid: i64,
    pub(crate) start_time_ms: i64,
    pub(crate) name: String,
    pub(crate) uid: i64,
    pub(crate) user: String,
    pub(crate) container_id: String,
    pub(crate) container_runtime: String,
    pub(crate) pod_uid: String,
    pub(crate) pod_qos_class: String,
    pub(crate) slurm_job_id: String,
    pub(crate) memory_used_bytes: i64,
    pub(crate) memory_peak_bytes: i64,
    pub(crate) first_seen_ms: i64,
    pub(crate) last_seen_ms: i64,
    pub(crate) alloc_ts_ms: Option<i64>,
    pub(crate) alloc_allocated: Option<i64>,
    pub(crate) alloc_reserved: Option<i64>,
    pub(crate) alloc_inactive_split: Option<i64>,
    pub(crate) alloc_peak_allocated: Option<i64>,
    pub(crate) alloc_retries: Option<i64>,
    pub(crate) alloc_ooms: Option<i64>,
    pub(crate) alloc_weights: Option<i64>,
    pub(crate) alloc_weights_dtype: Option<String>,
    pub(crate) alloc_gradients: Option<i64>,
    pub(crate) alloc_gradients_dtype: Option<String>,
    pub(crate) alloc_optimizer_state: Option<i64>,
    pub(crate) alloc_optimizer_state_dtype: Option<String>,
}

impl ProcessRow {
    /// Puts `report` in the `alloc_*` columns, as its checkpoint would
    /// write them: for a read that knows a newer report than the row.
    pub(crate) fn lay_allocator_over(&mut self, report: &crate::model::AllocatorRow) {
        let [weights, gradients, optimizer_state] = report.parts();
        self.alloc_ts_ms = Some(report.timestamp_ms);
        self.alloc_allocated = Some(report.allocated);
        self.alloc_reserved = Some(report.reserved);
        self.alloc_inactive_split = Some(report.inactive_split);
        self.alloc_peak_allocated = Some(report.peak_allocated);
        self.alloc_retries = Some(report.alloc_retries);
        self.alloc_ooms = Some(report.ooms);
        (self.alloc_weights, self.alloc_weights_dtype) = (weights.0, weights.1.map(String::from));
        (self.alloc_gradients, self.alloc_gradients_dtype) =
            (gradients.0, gradients.1.map(String::from));
        (self.alloc_optimizer_state, self.alloc_optimizer_state_dtype) =
            (optimizer_state.0, optimizer_state.1.map(String::from));
    }
}

/// The columns of an allocator report row as [`crate::model::AllocatorReport`]
/// reads them.
pub(crate) const ALLOCATOR_REPORT_COLUMNS: &str = "process_id, ts_ms AS timestamp_ms, allocated,
    reserved, active, inactive_split, peak_allocated, alloc_retries, ooms, weights, gradients,
    optimizer_state";

/// The process columns of [`ProcessRow`] besides its node and device.
pub(crate) const PROCESS_COLUMNS: &str = "p.pid, p.start_time_ms, p.name, p.uid, p.user_name AS user,
    p.container_id, p.container_runtime, p.pod_uid, p.pod_qos_class, p.slurm_job_id,
    p.memory_last AS memory_used_bytes, p.memory_peak AS memory_peak_bytes, p.first_seen_ms, p.last_seen_ms,
    p.alloc_ts_ms, p.alloc_allocated, p.alloc_reserved, p.alloc_inactive_split, p.alloc_peak_allocated,
    p.alloc_retries, p.alloc_ooms, p.alloc_weights, p.alloc_weights_dtype, p.alloc_gradients,
    p.alloc_gradients_dtype, p.alloc_optimizer_state, p.alloc_optimizer_state_dtype";

impl From<ProcessRow> for ProcessView {
    fn from(r: ProcessRow) -> Self {
        let allocator = match (r.alloc_ts_ms, r.alloc_allocated, r.alloc_reserved) {
            (Some(timestamp_ms), Some(allocated), Some(reserved)) => {
                let fragmentation = (reserved - allocated).max(0);
                let part = |bytes: Option<i64>, dtype: Option<&str>| {
                    bytes.map(|b| Part {
                        bytes: u64::try_from(b).unwrap_or(0),
                        dtype: dtype.map_or(Dtype::Other, Dtype::from_name),
                    })
                };
                let composition = Composition {
                    weights: part(r.alloc_weights, r.alloc_weights_dtype.as_deref()),
                    gradients: part(r.alloc_gradients, r.alloc_gradients_dtype.as_deref()),
                    optimizer_state: part(
                        r.alloc_optimizer_state,
                        r.alloc_optimizer_state_dtype.as_deref(),
                    ),
                };
                let as_u64 = |v: i64| u64::try_from(v).unwrap_or(0);
                let breakdown = (!composition.is_empty()).then(|| {
                    Breakdown::of(
                        &composition,
                        AllocatorFigures {
                            allocated: as_u64(allocated),
                            reserved: as_u64(reserved),
                            peak_allocated: as_u64(r.alloc_peak_allocated.unwrap_or(0)),
                        },
                        Some(as_u64(r.memory_used_bytes)),
                    )
                });
                Some(AllocatorLatest {
                    timestamp_ms,
                    allocated_bytes: allocated,
                    reserved_bytes: reserved,
                    fragmentation_bytes: fragmentation,
                    fragmentation_ratio: if reserved > 0 {
                        fragmentation as f64 / reserved as f64
                    } else {
                        0.0
                    },
                    inactive_split_bytes: r.alloc_inactive_split.unwrap_or(0),
                    peak_allocated_bytes: r.alloc_peak_allocated.unwrap_or(0),
                    alloc_retries: r.alloc_retries.unwrap_or(0),
                    ooms: r.alloc_ooms.unwrap_or(0),
                    breakdown,
                })
            }
            _ => None,
        };
        Self {
            node: r.node,
            device_uuid: r.device_uuid,
            gpu_index: r.gpu_index,
            pid: r.pid,
            start_time_ms: r.start_time_ms,
            name: r.name,
            uid: r.uid,
            user: r.user,
            container_id: r.container_id,
            container_runtime: r.container_runtime,
            pod_uid: r.pod_uid,
            pod_qos_class: r.pod_qos_class,
            slurm_job_id: r.slurm_job_id,
            memory_used_bytes: r.memory_used_bytes,
            memory_peak_bytes: r.memory_peak_bytes,
            first_seen_ms: r.first_seen_ms,
            last_seen_ms: r.last_seen_ms,
            allocator,
        }
    }
}

/// A present device of a node, as both backends read it for a session.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct SessionDevice {
    pub(crate) id: i64,
    pub(crate) uuid: String,
    pub(crate) gpu_index: i64,
    pub(crate) mig_profile: Option<String>,
    pub(crate) parent_id: Option<i64>,
    pub(crate) memory_total: i64,
}

/// How many devices a node has on record once `registering` joins the
/// `counted` it already has.
pub(crate) fn counted_with(counted: &[String], registering: &[&str]) -> usize {
    let known: std::collections::HashSet<&str> = counted.iter().map(String::as_str).collect();
    known.len() + registering.iter().filter(|u| !known.contains(*u)).count()
}

pub(crate) fn session_from(
    node_id: i64,
    node: &str,
    boot_id: &str,
    committed_seq: i64,
    durable_seq: i64,
    rows: Vec<SessionDevice>,
) -> NodeSession {
    let mut device_ids = HashMap::with_capacity(rows.len());
    let mut devices = HashMap::with_capacity(rows.len());
    for row in rows {
        device_ids.insert(row.uuid.clone(), row.id);
        devices.insert(
            row.id,
            DeviceMeta {
                uuid: row.uuid,
                gpu_index: u32::try_from(row.gpu_index).unwrap_or(0),
                mig_profile: row.mig_profile,
                parent_id: row.parent_id,
                memory_total: row.memory_total,
            },
        );
    }
    NodeSession {
        node_id,
        node: node.to_owned(),
        boot_id: boot_id.to_owned(),
        committed_seq: u64::try_from(committed_seq).unwrap_or(0),
        durable_seq: u64::try_from(durable_seq.min(committed_seq)).unwrap_or(0),
        device_ids,
        devices,
    }
}

/// Row shape shared by both backends for `latest_devices`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct DeviceRow {
    pub(crate) device_id: i64,
    pub(crate) uuid: String,
    pub(crate) node: String,
    pub(crate) parent_uuid: Option<String>,
    pub(crate) gpu_index: i64,
    pub(crate) name: String,
    pub(crate) mig_profile: Option<String>,
    pub(crate) mig_gpu_instance_id: Option<i64>,
    pub(crate) mig_compute_instance_id: Option<i64>,
    pub(crate) memory_total: i64,
    pub(crate) ts_ms: Option<i64>,
    pub(crate) used_last: Option<i64>,
    pub(crate) used_min: Option<i64>,
    pub(crate) used_max: Option<i64>,
    pub(crate) reserved: Option<i64>,
    pub(crate) total: Option<i64>,
    pub(crate) utilization: Option<i64>,
    pub(crate) pcie_tx: Option<i64>,
    pub(crate) pcie_rx: Option<i64>,
}

impl From<&GpuSampleRow> for LatestSample {
    fn from(s: &GpuSampleRow) -> Self {
        LatestSample::new(
            s.timestamp_ms,
            s.used_last,
            s.used_min,
            s.used_max,
            s.reserved,
            s.total,
            s.utilization_pct.map(i64::from),
            s.pcie_tx_bytes_per_s,
            s.pcie_rx_bytes_per_s,
        )
    }
}

impl From<DeviceRow> for DeviceView {
    fn from(r: DeviceRow) -> Self {
        let latest = match (
            r.ts_ms,
            r.used_last,
            r.used_min,
            r.used_max,
            r.reserved,
            r.total,
        ) {
            (Some(ts), Some(last), Some(min), Some(max), Some(reserved), Some(total)) => {
                Some(LatestSample::new(
                    ts,
                    last,
                    min,
                    max,
                    reserved,
                    total,
                    r.utilization,
                    r.pcie_tx,
                    r.pcie_rx,
                ))
            }
            _ => None,
        };
        DeviceView {
            uuid: r.uuid.into(),
            node: r.node.into(),
            kind: if r.parent_uuid.is_some() {
                "mig"
            } else {
                "gpu"
            },
            parent_uuid: r.parent_uuid.map(Into::into),
            index: r.gpu_index,
            name: r.name.into(),
            mig_profile: r.mig_profile.map(Into::into),
            mig_gpu_instance_id: r.mig_gpu_instance_id,
            mig_compute_instance_id: r.mig_compute_instance_id,
            memory_total_bytes: r.memory_total,
            latest,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_range_in_at_most_max_points() {
        // [0, 999] is 1000 ms: one per point; [0, 1000] is one more.
        assert_eq!(bucket_width_ms(0, 999, 1000), 1);
        assert_eq!(bucket_width_ms(0, 1000, 1000), 2);
        assert_eq!(bucket_width_ms(0, 86_399_999, 1000), 86_400);
        assert_eq!(bucket_width_ms(0, 1001, 1000), 2);
        assert_eq!(bucket_width_ms(5, 5, 0), 1);
    }
}
