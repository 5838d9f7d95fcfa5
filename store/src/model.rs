//! Domain types on the write side, after validation: what the store accepts.
//! Protocol types never get past `ingest`; byte counts are `i64` here because
//! that is what both databases store (validation rejects larger values).

use std::collections::HashMap;

use headroom_common::Composition;

/// A node's registration: who it is and what it has.
#[derive(Debug, Clone, PartialEq)]
pub struct Registration {
    pub node: String,
    pub boot_id: String,
    pub agent_version: String,
    pub driver_version: String,
    pub sample_interval_ms: u32,
    /// GPUs first, then MIG instances, each after its parent.
    pub devices: Vec<DeviceInfo>,
    pub budget: DeviceBudget,
}

/// How many devices one node may have on record, so that no sender can
/// grow the collector's inventory (and every session's device map) without
/// bound by registering new UUIDs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBudget {
    pub max_per_node: usize,
    /// A device absent this long no longer counts: no sample for it can
    /// still be accepted (older samples are refused).
    pub forget_absent_after_ms: i64,
}

impl Default for DeviceBudget {
    fn default() -> Self {
        Self {
            max_per_node: 1024,
            forget_absent_after_ms: 7 * 24 * 3600 * 1000,
        }
    }
}

impl DeviceBudget {
    /// The refusal when `on_record` (the node's counted devices, with this
    /// registration's) is over the budget.
    pub fn check(&self, node: &str, on_record: usize) -> Result<(), crate::StoreError> {
        if on_record > self.max_per_node {
            return Err(crate::StoreError::TooManyDevices {
                node: node.to_owned(),
                count: on_record,
                limit: self.max_per_node,
                forget_after_h: self.forget_absent_after_ms / 3_600_000,
            });
        }
        Ok(())
    }
}

/// A GPU or a MIG instance.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    pub uuid: String,
    /// The GPU a MIG instance lives in.
    pub parent_uuid: Option<String>,
    pub index: u32,
    pub name: String,
    pub memory_total: i64,
    pub pcie_generation: u32,
    pub pcie_width: u32,
    pub mig: Option<MigPlacement>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MigPlacement {
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub profile: String,
}

/// What the store knows about one agent boot: the ids of its node and
/// devices, the highest batch it accepted and the highest whose samples
/// are durable.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeSession {
    pub node_id: i64,
    pub node: String,
    pub boot_id: String,
    pub committed_seq: u64,
    /// At most `committed_seq`: a store that writes samples in chunks holds
    /// the newest batches' samples in memory until a flush. The agent
    /// replays everything after it.
    pub durable_seq: u64,
    pub device_ids: HashMap<String, i64>,
    pub devices: HashMap<i64, DeviceMeta>,
}

/// What rules and notifications say about a device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceMeta {
    pub uuid: String,
    pub gpu_index: u32,
    pub mig_profile: Option<String>,
    /// The GPU a MIG instance lives in.
    pub parent_id: Option<i64>,
    /// As registered: no process can hold more.
    pub memory_total: i64,
}

/// One validated batch with device UUIDs resolved to ids.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StoreBatch {
    pub node_id: i64,
    pub boot_id: String,
    pub seq: u64,
    pub gpu_samples: Vec<GpuSampleRow>,
    pub process_samples: Vec<ProcessSampleRow>,
    pub events: Vec<EventRow>,
}

impl StoreBatch {
    /// Newest timestamp in the batch, for the node's last-seen time.
    pub fn newest_timestamp_ms(&self) -> Option<i64> {
        let gpus = self.gpu_samples.iter().map(|s| s.timestamp_ms);
        let procs = self.process_samples.iter().map(|s| s.timestamp_ms);
        let events = self.events.iter().map(|e| e.timestamp_ms);
        gpus.chain(procs).chain(events).max()
    }
}

/// Serialized where a collector hands its open samples to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct GpuSampleRow {
    pub device_id: i64,
    pub timestamp_ms: i64,
    pub interval_ms: i32,
    pub poll_count: i32,
    pub used_last: i64,
    pub used_min: i64,
    pub used_max: i64,
    pub reserved: i64,
    pub total: i64,
    pub utilization_pct: Option<i16>,
    pub pcie_tx_bytes_per_s: Option<i64>,
    pub pcie_rx_bytes_per_s: Option<i64>,
}

/// A process sample as stored: the process by its row id, and its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct ProcessPoint {
    pub process_id: i64,
    pub timestamp_ms: i64,
    pub used_last: i64,
    pub used_max: i64,
}

/// One allocator report as stored: the process by its row id, the time the
/// process took the snapshot, and its figures (`AllocatorRow`'s, the
/// composition's bytes without their dtypes, which only the process's row
/// keeps).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, sqlx::FromRow,
)]
pub struct AllocatorReport {
    pub process_id: i64,
    pub timestamp_ms: i64,
    pub allocated: i64,
    pub reserved: i64,
    pub active: i64,
    pub inactive_split: i64,
    pub peak_allocated: i64,
    pub alloc_retries: i64,
    pub ooms: i64,
    pub weights: Option<i64>,
    pub gradients: Option<i64>,
    pub optimizer_state: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ProcessSampleRow {
    pub device_id: i64,
    pub timestamp_ms: i64,
    pub pid: i64,
    pub start_time_ms: i64,
    pub used_last: i64,
    pub used_max: i64,
    pub name: String,
    pub uid: i64,
    pub user: String,
    pub container_id: String,
    pub container_runtime: String,
    pub pod_uid: String,
    pub pod_qos_class: String,
    pub slurm_job_id: String,
    /// The pod's namespace and the Slurm job's account, where the agent
    /// read them. They reach the rules (and so the labels stored with an
    /// alert, which routes match) but no table's columns.
    pub pod_namespace: String,
    pub slurm_account: String,
    /// The process group on its node (0: unknown); job reports group the
    /// processes of neither a Slurm job nor a pod by it. Not stored either.
    pub process_group: u32,
    /// The pod's forwarded labels, sorted by key; as the two above, for the
    /// rules only.
    pub pod_labels: Vec<(String, String)>,
    /// What the process's own allocator reported, when it reports.
    pub allocator: Option<AllocatorRow>,
}

/// A framework allocator's counters for one process on one device
/// (PyTorch's `torch.cuda.memory_stats()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorRow {
    /// When the process took the snapshot.
    pub timestamp_ms: i64,
    pub allocated: i64,
    pub reserved: i64,
    pub active: i64,
    pub inactive_split: i64,
    pub peak_allocated: i64,
    /// Cumulative since the process started.
    pub alloc_retries: i64,
    pub ooms: i64,
    /// What the process's client counted in its own tensors, checked
    /// against the figures above.
    pub composition: Option<Composition>,
}

impl AllocatorRow {
    /// The report as stored for the process whose row id is `process_id`.
    pub fn report(&self, process_id: i64) -> AllocatorReport {
        let [weights, gradients, optimizer_state] = self.parts().map(|(bytes, _)| bytes);
        AllocatorReport {
            process_id,
            timestamp_ms: self.timestamp_ms,
            allocated: self.allocated,
            reserved: self.reserved,
            active: self.active,
            inactive_split: self.inactive_split,
            peak_allocated: self.peak_allocated,
            alloc_retries: self.alloc_retries,
            ooms: self.ooms,
            weights,
            gradients,
            optimizer_state,
        }
    }

    /// Weights, gradients and optimizer state as stored: bytes (NULL where
    /// not counted) and the dtype holding most of them.
    pub(crate) fn parts(&self) -> [(Option<i64>, Option<&'static str>); 3] {
        let c = self.composition.unwrap_or_default();
        [c.weights, c.gradients, c.optimizer_state].map(|p| {
            (
                p.map(|p| i64::try_from(p.bytes).unwrap_or(i64::MAX)),
                p.map(|p| p.dtype.as_str()),
            )
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct EventRow {
    pub device_id: Option<i64>,
    pub timestamp_ms: i64,
    pub kind: &'static str,
    pub code: i64,
    pub pid: i64,
    pub detail: String,
}

/// What one flush of open chunks wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlushReport {
    pub chunks: usize,
    /// Compressed bytes of those chunks (before row and index overhead).
    pub chunk_bytes: usize,
    /// GPU samples, process samples and allocator reports.
    pub samples: usize,
    /// Samples left out because another collector had written them.
    pub left_out: usize,
}

/// The outcome of a write: stored now, or already stored by an earlier copy
/// of the same batch (a replay).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Committed,
    /// Accepted before (its events stored, its rules run) but its samples
    /// were not yet durable: a collector that held them in memory died, or
    /// the agent moved to another. Its samples are taken again, nothing
    /// else is.
    Replayed,
    Duplicate {
        committed_seq: u64,
    },
}
