//! The scenario file exactly as written, before validation. Integers that
//! have a valid range are read as `i64` so that an out-of-range value gets a
//! message naming its node, GPU and pid instead of a bare serde type error.

use serde::Deserialize;

use crate::shape::MemoryShape;
use headroom_common::bytes::{ByteRate, ByteSize};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ScenarioFile {
    #[serde(default)]
    pub seed: u64,
    #[serde(default, rename = "node")]
    pub nodes: Vec<NodeFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NodeFile {
    pub name: String,
    pub driver_version: Option<String>,
    #[serde(default, rename = "gpu")]
    pub gpus: Vec<GpuFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GpuFile {
    pub model: String,
    pub memory_total: ByteSize,
    #[serde(default)]
    pub reserved: ByteSize,
    pub count: Option<i64>,
    pub utilization: Option<i64>,
    #[serde(default)]
    pub pcie_tx: ByteRate,
    #[serde(default)]
    pub pcie_rx: ByteRate,
    #[serde(default)]
    pub unattributed: ByteSize,
    #[serde(default)]
    pub mig: Vec<MigFile>,
    #[serde(default, rename = "process")]
    pub processes: Vec<ProcessFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MigFile {
    pub profile: String,
    pub memory_total: ByteSize,
    pub gpu_instance_id: Option<i64>,
    pub compute_instance_id: Option<i64>,
    #[serde(default, rename = "process")]
    pub processes: Vec<ProcessFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProcessFile {
    pub pid: i64,
    pub name: String,
    pub user: Option<String>,
    pub uid: Option<i64>,
    #[serde(default)]
    pub container_id: String,
    #[serde(default)]
    pub pod_uid: String,
    #[serde(default)]
    pub pod_namespace: String,
    #[serde(default)]
    pub slurm_job_id: String,
    #[serde(default)]
    pub slurm_account: String,
    /// Default: the process leads its own group.
    pub process_group: Option<i64>,
    /// The pod's labels, as the API server would give them.
    #[serde(default)]
    pub pod_labels: std::collections::BTreeMap<String, String>,
    pub start_s: Option<f64>,
    pub end_s: Option<f64>,
    pub memory: MemoryShape,
    /// The process reports its allocator's statistics (a PyTorch job with
    /// clients/python enabled).
    pub allocator: Option<AllocatorFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AllocatorFile {
    /// Share of the allocator's reservation in no live tensor, 0 to < 1.
    pub fragmentation: Option<f64>,
    /// `cudaMalloc` retries per minute of the process's life.
    pub retries_per_min: Option<f64>,
    /// Scenario time at which the allocator counts an out-of-memory error.
    pub oom_at_s: Option<f64>,
    /// What the job's client counts in its tensors (`enable(model=,
    /// optimizer=)`); absent for a job that reports the allocator only.
    pub composition: Option<CompositionFile>,
}

/// Shares of the process's live tensors; the rest is activations and
/// temporaries.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompositionFile {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer_state: f64,
    /// Of the weights and gradients, as PyTorch names it; default float32.
    pub dtype: Option<String>,
    /// Of the optimizer state; default float32.
    pub optimizer_dtype: Option<String>,
}
