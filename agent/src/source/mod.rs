//! Where GPU readings come from. `GpuSource` is the one seam between the agent
//! and the hardware: the real NVML source and the simulated one are equals
//! behind it.

mod sim;

pub use sim::SimSource;

/// What a node has: GPUs and, for those in MIG mode, their instances.
#[derive(Debug, Clone, PartialEq)]
pub struct Inventory {
    pub driver_version: String,
    pub gpus: Vec<GpuDevice>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GpuDevice {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
    pub pcie_generation: u32,
    pub pcie_width: u32,
    pub mig_instances: Vec<MigDevice>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MigDevice {
    pub uuid: String,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub profile: String,
    pub memory_total: u64,
}

/// One fast poll of every device on the node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Poll {
    /// GPUs and MIG instances alike, keyed by their UUID.
    pub devices: Vec<DeviceReading>,
    pub processes: Vec<ProcessReading>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeviceReading {
    pub uuid: String,
    pub memory_used: u64,
    pub memory_reserved: u64,
    pub memory_total: u64,
    pub utilization_pct: Option<u32>,
    pub pcie_tx_bytes_per_s: Option<u64>,
    pub pcie_rx_bytes_per_s: Option<u64>,
}

/// A process holding memory on one GPU or MIG instance, with what the agent
/// knows about who owns it.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessReading {
    /// The GPU or MIG instance the memory sits on.
    pub device_uuid: String,
    pub pid: u32,
    /// Unix epoch milliseconds; with `pid` it names one process across pid reuse.
    pub start_time_ms: i64,
    pub memory_used: u64,
    pub name: String,
    pub uid: u32,
    pub user: String,
    pub container_id: String,
    pub pod_uid: String,
    pub slurm_job_id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("node {0:?} is not in the scenario (it has: {1})")]
    UnknownSimNode(String, String),
    #[error("{0}")]
    Scenario(#[from] headroom_sim::ScenarioError),
}

/// A source of GPU readings. Calls block (NVML does), so the agent runs the
/// source on its own thread, never on the async runtime.
pub trait GpuSource: Send {
    fn inventory(&mut self) -> Result<Inventory, SourceError>;
    fn poll(&mut self) -> Result<Poll, SourceError>;
}
