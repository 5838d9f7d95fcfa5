//! Where GPU readings come from. `GpuSource` is the one seam between the agent
//! and the hardware: the real NVML source and the simulated one are equals
//! behind it.

mod nvml;
mod sim;

use std::sync::Arc;

use crate::allocator::AllocatorStats;

pub use nvml::{NvmlOptions, NvmlSource};
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
    /// As NVML writes it: `00000000:3B:00.0`; empty where NVML gives none.
    pub pci_bus_id: String,
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
    /// What happened since the previous poll (XID errors, lost or stalled
    /// GPUs, MIG layout changes).
    pub events: Vec<SourceEvent>,
    /// The node's new inventory when it changed since the last one handed
    /// out (a MIG reconfiguration); the collector must hear it before any
    /// sample of a new instance.
    pub inventory: Option<Inventory>,
    /// GPUs whose NVML calls have not returned within the watchdog's limit;
    /// they are missing from `devices` until they answer again.
    pub stalled: Vec<String>,
}

/// Something the hardware did, as opposed to a reading.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceEvent {
    pub kind: EventKind,
    pub timestamp_ms: i64,
    /// The GPU or MIG instance concerned; empty for the node as a whole.
    pub device_uuid: String,
    /// The XID for `Xid`; 0 otherwise.
    pub code: u32,
    pub pid: u32,
    pub detail: String,
}

impl SourceEvent {
    /// An event happening now, about `device_uuid`, with no code or pid.
    pub fn now(kind: EventKind, device_uuid: String, detail: String) -> Self {
        Self {
            kind,
            timestamp_ms: crate::time::epoch_ms_now(),
            device_uuid,
            code: 0,
            pid: 0,
            detail,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    Xid,
    GpuLost,
    MigReconfigured,
    /// An NVML call has not returned within the watchdog's limit.
    NvmlHung,
    /// NVML returned something impossible (a process holding more memory
    /// than its GPU has, pid 0); it was reported here and not stored as a
    /// reading.
    NvmlInvalidData,
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
    /// Read only for dcgm-exporter's names (`NvmlOptions::read_health`),
    /// once a second: no Headroom rule or chart needs them.
    pub health: Option<GpuHealth>,
}

/// What dashboards built for dcgm-exporter chart beside memory. Each is
/// `None` where the GPU does not report it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuHealth {
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
}

/// A process holding memory on one GPU or MIG instance, with what the agent
/// knows about who owns it.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessReading {
    /// The GPU or MIG instance the memory sits on.
    pub device_uuid: Arc<str>,
    pub pid: u32,
    /// Unix epoch milliseconds; with `pid` it names one process across pid
    /// reuse. 0 when unknown (the process was gone before `/proc` was read).
    pub start_time_ms: i64,
    pub memory_used: u64,
    pub owner: Arc<ProcessOwner>,
    /// What the process's allocator says, where the source itself knows
    /// (the simulator); real processes report on the allocator socket.
    pub allocator: Option<AllocatorStats>,
}

/// Who owns a process. Shared between polls: a poll of hundreds of
/// processes at 10 Hz hands out the same owners again and again, and a
/// reference count costs far less than copying five strings each time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessOwner {
    /// The command line.
    pub name: String,
    pub uid: u32,
    pub user: String,
    pub container_id: String,
    /// `docker`, `containerd`, `cri-o`, `podman`, `unknown`; empty outside a
    /// container.
    pub container_runtime: String,
    pub pod_uid: String,
    /// `guaranteed`, `burstable`, `besteffort`; empty when unknown.
    pub pod_qos_class: String,
    /// Empty outside a pod or where the kubelet's directory of it is not
    /// visible.
    pub pod_namespace: String,
    /// The pod's labels among those `pod_labels` forwards, sorted by key.
    pub pod_labels: Vec<(String, String)>,
    pub slurm_job_id: String,
    /// Empty outside Slurm or where the job's environment does not say.
    pub slurm_account: String,
    /// The process group; 0 when unknown.
    pub process_group: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(
        "cannot load the NVIDIA management library ({library}): {reason}. Is the NVIDIA driver installed? Point `nvml_library` (HEADROOM_NVML_LIBRARY) at libnvidia-ml.so.1 if it lives elsewhere; use --source sim only for a simulated fleet"
    )]
    NvmlLoad { library: String, reason: String },
    #[error("NVML call {call} failed: {reason}")]
    Nvml { call: &'static str, reason: String },
    #[error("cannot start an NVML thread: {0}")]
    Thread(#[from] std::io::Error),
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
