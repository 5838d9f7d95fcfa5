//! The scenario file exactly as written, before validation. Integers that
//! have a valid range are read as `i64` so that an out-of-range value gets a
//! message naming its node, GPU and pid instead of a bare serde type error.

use serde::Deserialize;

use crate::bytes::{ByteRate, ByteSize};
use crate::shape::MemoryShape;

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
    pub slurm_job_id: String,
    pub start_s: Option<f64>,
    pub end_s: Option<f64>,
    pub memory: MemoryShape,
}
