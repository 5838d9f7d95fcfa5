//! What the engine is fed: one interval of a GPU, MIG instance or process,
//! or one event, as the agent reported it. Plain data borrowed from the
//! decoded message; rules and the engine both read it, neither owns it.

use headroom_common::Breakdown;

use crate::allocator::AllocatorObservation;

/// Alert labels that carry a pod's labels: `pod_label.team` for `team`.
pub const POD_LABEL_PREFIX: &str = "pod_label.";

/// One interval of one GPU or MIG instance.
#[derive(Debug, Clone)]
pub struct DeviceObservation<'a> {
    pub node: &'a str,
    pub device_uuid: &'a str,
    pub gpu_index: u32,
    pub mig_profile: Option<&'a str>,
    pub timestamp_ms: i64,
    pub used_last: u64,
    pub used_max: u64,
    pub reserved: u64,
    pub total: u64,
    /// Memory held by the processes the agent could see on this device, when
    /// the agent reports processes for it.
    pub attributed: Option<u64>,
    /// Where the memory of the biggest process on it that counts its
    /// tensors goes, for a remedy that fits it.
    pub largest_process: Option<Breakdown>,
}

/// One interval of one process on one device.
#[derive(Debug, Clone)]
pub struct ProcessObservation<'a> {
    pub node: &'a str,
    pub device_uuid: &'a str,
    pub gpu_index: u32,
    pub pid: u32,
    pub start_time_ms: i64,
    pub name: &'a str,
    pub user: &'a str,
    pub slurm_job_id: &'a str,
    /// Empty where unknown, as the other owner fields.
    pub slurm_account: &'a str,
    pub pod_uid: &'a str,
    pub pod_namespace: &'a str,
    /// The pod's labels the agent forwards, each an alert label
    /// `pod_label.<key>`.
    pub pod_labels: &'a [(String, String)],
    pub container_id: &'a str,
    pub timestamp_ms: i64,
    pub used_last: u64,
    pub used_max: u64,
    /// The newest report of the process's own allocator, when it reports.
    pub allocator: Option<AllocatorObservation>,
}

/// An event the agent reported (XID, lost GPU, hung NVML call, …).
#[derive(Debug, Clone)]
pub struct EventObservation<'a> {
    pub node: &'a str,
    pub device_uuid: Option<&'a str>,
    pub gpu_index: Option<u32>,
    /// The event kind as stored: `xid`, `gpu_lost`, `nvml_hung`, …
    pub kind: &'a str,
    pub code: i64,
    pub detail: &'a str,
    pub timestamp_ms: i64,
}
