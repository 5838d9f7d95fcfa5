//! What a node reports: static inventory and the readings at one instant.
//! Field meanings follow NVML, which these values stand in for.

use std::sync::Arc;

use headroom_common::Composition;

/// A GPU as enumerated at start-up (`nvmlDeviceGetHandleByIndex` & co).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    pub memory_total: u64,
    /// Domain 0, bus `index + 1`, device 0, as NVML writes it
    /// (`00000000:01:00.0`).
    pub pci_bus_id: String,
    pub pcie_generation: u32,
    pub pcie_width: u32,
    /// Empty unless the GPU is in MIG mode.
    pub mig: Vec<MigInfo>,
}

/// A MIG instance of a GPU in MIG mode.
#[derive(Debug, Clone, PartialEq)]
pub struct MigInfo {
    pub uuid: String,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    /// e.g. `3g.40gb`.
    pub profile: String,
    pub memory_total: u64,
}

/// One GPU's readings at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuState {
    pub uuid: String,
    /// As `nvmlMemory_v2_t::used`: excludes `memory_reserved`, includes memory
    /// no visible process accounts for, and never exceeds
    /// `memory_total - memory_reserved`.
    pub memory_used: u64,
    pub memory_reserved: u64,
    pub memory_total: u64,
    pub utilization_pct: u32,
    pub pcie_tx_bytes_per_s: u64,
    pub pcie_rx_bytes_per_s: u64,
    /// What `nvmlDeviceGetTemperature` (GPU sensor), `nvmlDeviceGetPowerUsage`
    /// and `nvmlDeviceGetClockInfo` (SM) answer: plausible figures that
    /// follow utilization, for tools and dashboards that chart them.
    pub temperature_c: u32,
    pub power_mw: u32,
    pub sm_clock_mhz: u32,
    /// Processes placed directly on the GPU; empty in MIG mode, where they
    /// are listed under their instance in `mig`.
    pub processes: Vec<ProcessState>,
    pub mig: Vec<MigState>,
}

/// One MIG instance's readings at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct MigState {
    pub uuid: String,
    /// The sum of its processes' memory.
    pub memory_used: u64,
    pub memory_total: u64,
    pub processes: Vec<ProcessState>,
}

/// What a reporting process's allocator says at one instant. The process's
/// memory is its CUDA context plus the allocator's reservation; the
/// reservation splits into live tensors and fragmented cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorSnapshot {
    pub allocated: u64,
    pub reserved: u64,
    pub active: u64,
    pub inactive_split: u64,
    pub peak_allocated: u64,
    pub alloc_retries: u64,
    pub ooms: u64,
    /// What the job's client counts in its tensors, for a job that counts.
    pub composition: Option<Composition>,
}

/// A process holding device memory at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessState {
    pub pid: u32,
    /// When this incarnation started, in milliseconds after the scenario
    /// started; a process restarted after an OOM gets a new value, which is
    /// how consumers tell a restart from a continuing process.
    pub start_time_ms: u64,
    // Shared with the scenario: evaluating hundreds of processes ten times
    // a second copies reference counts, not strings.
    pub name: Arc<str>,
    pub user: Arc<str>,
    pub uid: u32,
    pub container_id: Arc<str>,
    pub pod_uid: Arc<str>,
    pub pod_namespace: Arc<str>,
    pub slurm_job_id: Arc<str>,
    pub slurm_account: Arc<str>,
    pub process_group: u32,
    /// Sorted by key.
    pub pod_labels: Arc<[(String, String)]>,
    pub memory_used: u64,
    /// For a process that reports its allocator's statistics.
    pub allocator: Option<AllocatorSnapshot>,
}
