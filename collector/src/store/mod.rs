//! Storage behind one trait, with a Postgres implementation for production and
//! a SQLite one for a single machine and the demo. Both pass one conformance
//! suite (`tests/tests/store_conformance.rs`).

pub mod alerts;
mod postgres;
pub mod rollup;
mod sqlite;
pub mod tokens;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Serialize;

pub use alerts::AlertStore;
pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;
pub use tokens::TokenStore;

use crate::model::{DeviceMeta, GpuSampleRow, NodeSession, Registration, StoreBatch, WriteOutcome};
use rollup::{MaintenanceReport, StorageConfig, Watermarks};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("unsupported database URL {0:?}: use postgres://… or sqlite://…")]
    UnsupportedUrl(String),
    #[error("refused to store: {0}")]
    Invalid(String),
    /// Stored data that cannot be read back (a damaged packed chunk).
    #[error("stored data is damaged: {0}")]
    Damaged(String),
}

#[async_trait]
pub trait Store: AlertStore + TokenStore + Send + Sync + std::fmt::Debug + 'static {
    /// Records a node's (re)registration and its current inventory; devices the
    /// node no longer reports are marked absent, not deleted.
    async fn register(
        &self,
        registration: &Registration,
        now_ms: i64,
    ) -> Result<NodeSession, StoreError>;

    /// The session of an agent boot that registered earlier, if any.
    async fn session(&self, node: &str, boot_id: &str) -> Result<Option<NodeSession>, StoreError>;

    /// Writes batches, from any agents, in one transaction, leaving out each
    /// batch whose (node, boot) already committed the same or a higher `seq`:
    /// one outcome per batch, in order. Either all the new batches are
    /// stored or, on error, none.
    async fn write_batches(&self, batches: &[StoreBatch]) -> Result<Vec<WriteOutcome>, StoreError>;

    /// [`Store::write_batches`] for a single batch.
    async fn write_batch(&self, batch: &StoreBatch) -> Result<WriteOutcome, StoreError> {
        let outcomes = self.write_batches(std::slice::from_ref(batch)).await?;
        Ok(outcomes
            .into_iter()
            .next()
            .unwrap_or(WriteOutcome::Duplicate { committed_seq: 0 }))
    }

    /// One maintenance pass: partitions ahead of time, rollups of finished
    /// minutes and hours (and of late samples), retention. Where several
    /// collectors share a database only one of them does the work; the
    /// report says whether it was this one.
    async fn maintain(&self, now_ms: i64) -> Result<MaintenanceReport, StoreError>;

    /// How far the rollups are complete.
    async fn watermarks(&self) -> Result<Watermarks, StoreError>;

    /// Whether concurrent writes make progress together (Postgres) rather
    /// than queue for one lock (SQLite).
    fn parallel_writes(&self) -> bool;

    /// Releases the store's connections (and the maintenance lock, so that
    /// another collector takes over without waiting for a timeout).
    async fn close(&self);

    async fn nodes(&self) -> Result<Vec<NodeView>, StoreError>;

    /// The latest sample of every present GPU and MIG instance.
    async fn latest_devices(&self) -> Result<Vec<DeviceView>, StoreError>;

    /// Samples of one device in `[from_ms, to_ms]`, folded into at most
    /// `max_points` buckets. `None` when the device is unknown.
    async fn device_series(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Option<Vec<SeriesPoint>>, StoreError>;

    /// Processes seen since `since_ms`, with their latest and peak memory.
    async fn processes(&self, since_ms: i64) -> Result<Vec<ProcessView>, StoreError>;

    /// What the allocator of process `pid` on device `uuid` reported in
    /// `[from_ms, to_ms]`, folded into at most `max_points` buckets that keep
    /// each bucket's highest values. The newest incarnation of the pid
    /// unless `start_time_ms` names one. `None` when no such process.
    async fn allocator_series(
        &self,
        query: &AllocatorSeriesQuery<'_>,
    ) -> Result<Option<AllocatorSeries>, StoreError>;

    /// The memory of each process on device `uuid` in `[from_ms, to_ms]`,
    /// folded into the same buckets as [`Store::device_series`] (each
    /// bucket's highest value), the `MAX_PROCESSES_PER_SERIES` biggest
    /// first. Every process's points carry their bucket's end, so they stack;
    /// a device series point carries its newest sample, at most one sample
    /// interval earlier. `None` when the device is unknown.
    async fn process_series(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Option<Vec<ProcessSeries>>, StoreError>;

    /// Events the agent reported for device `uuid` in `[from_ms, to_ms]`,
    /// newest first, at most `limit`. `None` when the device is unknown.
    async fn device_events(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        limit: i64,
    ) -> Result<Option<Vec<EventView>>, StoreError>;
}

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

/// The process's id in the store, for series queries.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ProcessKey {
    pub id: i64,
    pub start_time_ms: i64,
}

/// Opens the store a URL names, creating and migrating its schema.
pub async fn connect(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    connect_with(url, StorageConfig::default()).await
}

/// [`connect`] with retention other than the defaults.
pub async fn connect_with(url: &str, storage: StorageConfig) -> Result<Arc<dyn Store>, StoreError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(PostgresStore::connect(url, storage).await?))
    } else if url.starts_with("sqlite:") {
        Ok(Arc::new(SqliteStore::connect(url, storage).await?))
    } else {
        Err(StoreError::UnsupportedUrl(redact_url(url)))
    }
}

/// Drops the password from a database URL before it reaches a message.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}://{}:***@{}", &url[..scheme_end], user, &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// Width of the buckets that fold `[from_ms, to_ms]` into at most `max_points`.
pub(crate) fn bucket_width_ms(from_ms: i64, to_ms: i64, max_points: u32) -> i64 {
    // Both ends are included: the range holds `to − from + 1` milliseconds.
    let span = to_ms.saturating_sub(from_ms).saturating_add(1).max(1);
    let points = i64::from(max_points.max(1));
    ((span + points - 1) / points).max(1)
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

/// A process row as both backends read it.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ProcessRow {
    node: String,
    device_uuid: String,
    gpu_index: i64,
    pid: i64,
    start_time_ms: i64,
    name: String,
    uid: i64,
    user: String,
    container_id: String,
    container_runtime: String,
    pod_uid: String,
    pod_qos_class: String,
    slurm_job_id: String,
    memory_used_bytes: i64,
    memory_peak_bytes: i64,
    first_seen_ms: i64,
    last_seen_ms: i64,
    alloc_ts_ms: Option<i64>,
    alloc_allocated: Option<i64>,
    alloc_reserved: Option<i64>,
    alloc_inactive_split: Option<i64>,
    alloc_peak_allocated: Option<i64>,
    alloc_retries: Option<i64>,
    alloc_ooms: Option<i64>,
}

/// The process columns of [`ProcessRow`] besides its node and device.
pub(crate) const PROCESS_COLUMNS: &str = "p.pid, p.start_time_ms, p.name, p.uid, p.user_name AS user,
    p.container_id, p.container_runtime, p.pod_uid, p.pod_qos_class, p.slurm_job_id,
    p.memory_last AS memory_used_bytes, p.memory_peak AS memory_peak_bytes, p.first_seen_ms, p.last_seen_ms,
    p.alloc_ts_ms, p.alloc_allocated, p.alloc_reserved, p.alloc_inactive_split, p.alloc_peak_allocated,
    p.alloc_retries, p.alloc_ooms";

impl From<ProcessRow> for ProcessView {
    fn from(r: ProcessRow) -> Self {
        let allocator = match (r.alloc_ts_ms, r.alloc_allocated, r.alloc_reserved) {
            (Some(timestamp_ms), Some(allocated), Some(reserved)) => {
                let fragmentation = (reserved - allocated).max(0);
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
    id: i64,
    uuid: String,
    gpu_index: i64,
    mig_profile: Option<String>,
    parent_id: Option<i64>,
}

pub(crate) fn session_from(
    node_id: i64,
    node: &str,
    boot_id: &str,
    committed_seq: i64,
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
            },
        );
    }
    NodeSession {
        node_id,
        node: node.to_owned(),
        boot_id: boot_id.to_owned(),
        committed_seq: u64::try_from(committed_seq).unwrap_or(0),
        device_ids,
        devices,
    }
}

/// Row shape shared by both backends for `latest_devices`.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct DeviceRow {
    device_id: i64,
    uuid: String,
    node: String,
    parent_uuid: Option<String>,
    gpu_index: i64,
    name: String,
    mig_profile: Option<String>,
    mig_gpu_instance_id: Option<i64>,
    mig_compute_instance_id: Option<i64>,
    memory_total: i64,
    ts_ms: Option<i64>,
    used_last: Option<i64>,
    used_min: Option<i64>,
    used_max: Option<i64>,
    reserved: Option<i64>,
    total: Option<i64>,
    utilization: Option<i64>,
    pcie_tx: Option<i64>,
    pcie_rx: Option<i64>,
}

impl DeviceRow {
    /// Replaces the row's latest figures with `sample` when it is newer:
    /// a sample committed by this collector that `gpu_latest` does not hold
    /// yet (Postgres checkpoints that table every few seconds).
    pub(crate) fn overlay_newer(
        &mut self,
        newer: impl FnOnce(i64, Option<i64>) -> Option<GpuSampleRow>,
    ) {
        let Some(s) = newer(self.device_id, self.ts_ms) else {
            return;
        };
        self.ts_ms = Some(s.timestamp_ms);
        self.used_last = Some(s.used_last);
        self.used_min = Some(s.used_min);
        self.used_max = Some(s.used_max);
        self.reserved = Some(s.reserved);
        self.total = Some(s.total);
        self.utilization = s.utilization_pct.map(i64::from);
        self.pcie_tx = s.pcie_tx_bytes_per_s;
        self.pcie_rx = s.pcie_rx_bytes_per_s;
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
            uuid: r.uuid,
            node: r.node,
            kind: if r.parent_uuid.is_some() {
                "mig"
            } else {
                "gpu"
            },
            parent_uuid: r.parent_uuid,
            index: r.gpu_index,
            name: r.name,
            mig_profile: r.mig_profile,
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
    fn passwords_never_reach_messages() {
        assert_eq!(
            redact_url("postgres://headroom:s3cret@db:5432/headroom"),
            "postgres://headroom:***@db:5432/headroom"
        );
        assert_eq!(redact_url("sqlite://data.db"), "sqlite://data.db");
    }

    #[test]
    fn buckets_cover_the_range_in_at_most_max_points() {
        // [0, 999] is 1000 ms: one per point; [0, 1000] is one more.
        assert_eq!(bucket_width_ms(0, 999, 1000), 1);
        assert_eq!(bucket_width_ms(0, 1000, 1000), 2);
        assert_eq!(bucket_width_ms(0, 86_399_999, 1000), 86_400);
        assert_eq!(bucket_width_ms(0, 1001, 1000), 2);
        assert_eq!(bucket_width_ms(5, 5, 0), 1);
    }

    #[test]
    fn headroom_excludes_used_and_reserved() {
        let s = LatestSample::new(0, 60, 50, 70, 10, 100, None, None, None);
        assert_eq!(s.headroom_bytes, 30);
        assert_eq!(s.peak_headroom_bytes, 20);
        assert!((s.headroom_pct - 30.0).abs() < 1e-9);
    }
}
