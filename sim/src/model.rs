//! The validated fleet: what a scenario file means once defaults are applied,
//! `count` is expanded and identities are assigned.

use std::sync::Arc;

use headroom_common::Dtype;

use crate::shape::MemoryShape;

/// One simulated machine. Build it through [`crate::Scenario`]; evaluate it
/// with [`NodeSpec::inventory`] and [`NodeSpec::state_at`].
#[derive(Debug, Clone, PartialEq)]
pub struct NodeSpec {
    pub name: String,
    pub driver_version: String,
    pub(crate) seed: u64,
    pub(crate) gpus: Vec<Gpu>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_total: u64,
    pub reserved: u64,
    pub unattributed: u64,
    /// Configured busy utilization; `None` means the default.
    pub utilization_pct: Option<u32>,
    pub pcie_tx: u64,
    pub pcie_rx: u64,
    /// Processes placed directly on the GPU; always empty in MIG mode.
    pub processes: Vec<Process>,
    pub mig: Vec<MigInstance>,
}

impl Gpu {
    /// The memory processes placed directly on the GPU can use.
    pub(crate) fn process_capacity(&self) -> u64 {
        self.memory_total
            .saturating_sub(self.reserved)
            .saturating_sub(self.unattributed)
    }

    /// NVIDIA's Hopper parts are PCIe Gen5; everything else in a typical
    /// fleet (Ampere, Ada) is Gen4.
    pub(crate) fn pcie_generation(&self) -> u32 {
        if self.model.contains("H100") || self.model.contains("H200") {
            5
        } else {
            4
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MigInstance {
    pub uuid: String,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub profile: String,
    pub memory_total: u64,
    pub processes: Vec<Process>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Process {
    pub pid: u32,
    pub name: Arc<str>,
    pub user: Arc<str>,
    pub uid: u32,
    pub container_id: Arc<str>,
    pub pod_uid: Arc<str>,
    pub pod_namespace: Arc<str>,
    pub slurm_job_id: Arc<str>,
    pub slurm_account: Arc<str>,
    /// `None`: the process leads its own group (each copy its own).
    pub process_group: Option<u32>,
    pub pod_labels: Arc<[(String, String)]>,
    pub start_s: f64,
    pub end_s: Option<f64>,
    pub memory: MemoryShape,
    pub allocator: Option<AllocatorModel>,
}

/// How a reporting process's allocator behaves; see `AllocatorSnapshot`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AllocatorModel {
    pub fragmentation: f64,
    pub retries_per_min: f64,
    pub oom_at_s: Option<f64>,
    pub composition: Option<CompositionModel>,
}

/// Shares of the live tensors the client counts, and their dtypes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CompositionModel {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer_state: f64,
    pub dtype: Dtype,
    pub optimizer_dtype: Dtype,
}

impl Process {
    /// Seconds since the process started, if `t` falls within its configured
    /// lifetime (OOM deaths are decided separately by its shape).
    pub(crate) fn elapsed_at(&self, t: f64) -> Option<f64> {
        let started = t >= self.start_s;
        let ended = self.end_s.is_some_and(|end| t >= end);
        (started && !ended).then_some(t - self.start_s)
    }
}
