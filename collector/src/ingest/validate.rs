//! Turns wire messages into domain types, rejecting anything a correct agent
//! could not have sent. Each error names the field and the value at fault, so
//! the operator reading the agent's log knows what to fix.

use std::collections::HashSet;
use std::fmt;

use headroom_common::{Composition, Dtype, Part};
use headroom_proto::v1 as pb;

use headroom_store::model::{
    AllocatorRow, DeviceBudget, DeviceInfo, EventRow, GpuSampleRow, MigPlacement, NodeSession,
    ProcessSampleRow, Registration, StoreBatch,
};

/// Bounds on what one agent may send (`[limits]` in the collector's
/// configuration). The defaults fit the largest real nodes (8–16 GPUs, 7 MIG
/// instances each, hundreds of processes) with room.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_devices: usize,
    pub max_samples_per_batch: usize,
    pub max_id_len: usize,
    pub max_name_len: usize,
    /// How far ahead of the collector's clock a sample may be.
    pub max_future_skew_ms: i64,
    /// How old a sample may be: keep it above the span an agent's spool
    /// holds (about four days at the defaults), or a long outage's replay
    /// is refused.
    pub max_age_ms: i64,
    /// Largest gRPC message (one batch or registration) the collector
    /// decodes; a bigger one ends the stream with `RESOURCE_EXHAUSTED`.
    /// Agents cut their batches at 2 MiB, so at least 4 MiB.
    pub max_message_bytes: usize,
    /// How far a batch's seq may run ahead of its stream's committed
    /// watermark. An agent skips numbers only for batches its full spool
    /// dropped; a jump beyond this is refused, so one forged number cannot
    /// make the stream's later batches look like replays.
    pub max_seq_gap: u64,
    /// Devices a node may have on record, present or absent for less than
    /// `max_age_ms`; a registration that would add more is refused.
    pub max_devices_per_node: usize,
    /// Agent sessions (boots) of one node the collector keeps in memory; the
    /// least recently used is reloaded from the store when it sends again.
    pub max_sessions_per_node: usize,
    /// Concurrent gRPC streams on one connection (an agent uses one).
    pub max_streams_per_connection: u32,
    /// A gRPC connection that sends nothing for this long is closed. Agents
    /// ping every 15 s, even while waiting for an answer.
    pub grpc_idle_timeout_s: u64,
}

impl Limits {
    /// What is wrong with these limits, if anything.
    pub fn problem(&self) -> Option<String> {
        if self.max_devices == 0 || self.max_samples_per_batch == 0 {
            return Some(
                "[limits] max_devices and max_samples_per_batch must be at least 1".into(),
            );
        }
        if self.max_id_len < 64 || self.max_name_len < 64 {
            return Some(
                "[limits] max_id_len and max_name_len must be at least 64 (a container id is 64 bytes)"
                    .into(),
            );
        }
        if self.max_future_skew_ms < 1000 {
            return Some("[limits] max_future_skew_ms must be at least 1000".into());
        }
        if self.max_message_bytes < 4 << 20 {
            return Some(format!(
                "[limits] max_message_bytes = {} is below 4 MiB ({}): agents send batches of up to 2 MiB",
                self.max_message_bytes,
                4 << 20
            ));
        }
        if self.max_seq_gap < 1000 {
            return Some("[limits] max_seq_gap must be at least 1000".into());
        }
        if self.max_devices_per_node < self.max_devices {
            return Some(format!(
                "[limits] max_devices_per_node = {} is below max_devices = {}: a node could not register its own inventory",
                self.max_devices_per_node, self.max_devices
            ));
        }
        if self.max_sessions_per_node == 0 || self.max_streams_per_connection == 0 {
            return Some(
                "[limits] max_sessions_per_node and max_streams_per_connection must be at least 1"
                    .into(),
            );
        }
        if self.grpc_idle_timeout_s < 30 {
            return Some(
                "[limits] grpc_idle_timeout_s must be at least 30: agents ping every 15 s".into(),
            );
        }
        if self.max_age_ms < 3_600_000 {
            return Some(
                "[limits] max_age_ms must be at least 3600000 (an hour): agents replay what they spooled"
                    .into(),
            );
        }
        None
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_devices: 256,
            max_samples_per_batch: 20_000,
            max_id_len: 256,
            max_name_len: 4096,
            max_future_skew_ms: 5 * 60 * 1000,
            max_age_ms: 7 * 24 * 3600 * 1000,
            max_message_bytes: 16 << 20,
            max_seq_gap: 10_000_000,
            max_devices_per_node: 1024,
            max_sessions_per_node: 8,
            max_streams_per_connection: 16,
            grpc_idle_timeout_s: 120,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid<T>(message: String) -> Result<T, Invalid> {
    Err(Invalid(message))
}

/// Text from outside as it may appear in a log line or an error sent back:
/// quoted, and cut after [`Clipped::KEEP`] characters with the full length
/// stated, so a megabyte of node name costs a line, not a megabyte.
#[derive(Debug)]
pub struct Clipped<'a>(pub &'a str);

impl Clipped<'_> {
    pub const KEEP: usize = 64;
}

impl fmt::Display for Clipped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(Self::KEEP) {
            None => write!(f, "{:?}", self.0),
            Some((cut, _)) => write!(f, "{:?}… ({} bytes)", &self.0[..cut], self.0.len()),
        }
    }
}

/// Pod labels a process may carry: the agent forwards at most 8.
const MAX_POD_LABELS: usize = 16;

fn check_text(
    field: impl fmt::Display,
    value: &str,
    max: usize,
    required: bool,
) -> Result<(), Invalid> {
    if required && value.is_empty() {
        return invalid(format!("{field} is empty"));
    }
    if value.len() > max {
        return invalid(format!(
            "{field} is {} bytes long (limit {max})",
            value.len()
        ));
    }
    if value.chars().any(char::is_control) {
        return invalid(format!(
            "{field} {} contains control characters",
            Clipped(value)
        ));
    }
    Ok(())
}

fn bytes(field: impl fmt::Display, value: u64) -> Result<i64, Invalid> {
    i64::try_from(value)
        .or_else(|_| invalid(format!("{field} = {value} is not a plausible byte count")))
}

pub fn registration(req: &pb::RegisterRequest, limits: &Limits) -> Result<Registration, Invalid> {
    check_text("node", &req.node, 253, true)?;
    check_text("boot_id", &req.boot_id, limits.max_id_len, true)?;
    check_text(
        "agent_version",
        &req.agent_version,
        limits.max_id_len,
        false,
    )?;
    check_text(
        "driver_version",
        &req.driver_version,
        limits.max_id_len,
        false,
    )?;
    if req.sample_interval_ms == 0 || req.sample_interval_ms > 3_600_000 {
        return invalid(format!(
            "sample_interval_ms = {} is outside 1..=3600000",
            req.sample_interval_ms
        ));
    }
    let mig_count: usize = req.gpus.iter().map(|g| g.mig_instances.len()).sum();
    if req.gpus.len() + mig_count > limits.max_devices {
        return invalid(format!(
            "{} GPUs and MIG instances exceed the limit of {}",
            req.gpus.len() + mig_count,
            limits.max_devices
        ));
    }
    let mut seen = HashSet::new();
    let mut devices = Vec::with_capacity(req.gpus.len() + mig_count);
    for gpu in &req.gpus {
        check_text("gpu uuid", &gpu.uuid, limits.max_id_len, true)?;
        check_text(
            format!("name of GPU {}", gpu.uuid),
            &gpu.name,
            limits.max_id_len,
            false,
        )?;
        if !seen.insert(gpu.uuid.as_str()) {
            return invalid(format!("GPU uuid {} appears twice", gpu.uuid));
        }
        let total = bytes(
            format!("memory_total_bytes of GPU {}", gpu.uuid),
            gpu.memory_total_bytes,
        )?;
        if total == 0 {
            return invalid(format!("GPU {} reports memory_total_bytes = 0", gpu.uuid));
        }
        devices.push(DeviceInfo {
            uuid: gpu.uuid.clone(),
            parent_uuid: None,
            index: gpu.index,
            name: gpu.name.clone(),
            memory_total: total,
            pcie_generation: gpu.pcie_generation,
            pcie_width: gpu.pcie_width,
            mig: None,
        });
        let mut mig_total: i64 = 0;
        for mig in &gpu.mig_instances {
            check_text("MIG uuid", &mig.uuid, limits.max_id_len, true)?;
            check_text(
                format!("profile of MIG {}", mig.uuid),
                &mig.profile,
                limits.max_id_len,
                false,
            )?;
            if !seen.insert(mig.uuid.as_str()) {
                return invalid(format!("MIG uuid {} appears twice", mig.uuid));
            }
            let mig_bytes = bytes(
                format!("memory_total_bytes of MIG {}", mig.uuid),
                mig.memory_total_bytes,
            )?;
            if mig_bytes == 0 {
                return invalid(format!(
                    "MIG instance {} reports memory_total_bytes = 0",
                    mig.uuid
                ));
            }
            mig_total = mig_total.saturating_add(mig_bytes);
            devices.push(DeviceInfo {
                uuid: mig.uuid.clone(),
                parent_uuid: Some(gpu.uuid.clone()),
                index: gpu.index,
                name: format!("{} MIG {}", gpu.name, mig.profile),
                memory_total: mig_bytes,
                pcie_generation: gpu.pcie_generation,
                pcie_width: gpu.pcie_width,
                mig: Some(MigPlacement {
                    gpu_instance_id: mig.gpu_instance_id,
                    compute_instance_id: mig.compute_instance_id,
                    profile: mig.profile.clone(),
                }),
            });
        }
        if mig_total > total {
            return invalid(format!(
                "MIG instances of GPU {} add up to {mig_total} bytes, more than its {total}",
                gpu.uuid
            ));
        }
    }
    Ok(Registration {
        node: req.node.clone(),
        boot_id: req.boot_id.clone(),
        agent_version: req.agent_version.clone(),
        driver_version: req.driver_version.clone(),
        sample_interval_ms: req.sample_interval_ms,
        devices,
        budget: DeviceBudget {
            max_per_node: limits.max_devices_per_node,
            forget_absent_after_ms: limits.max_age_ms,
        },
    })
}

fn timestamp(
    field: impl fmt::Display,
    ts: i64,
    now_ms: i64,
    limits: &Limits,
) -> Result<i64, Invalid> {
    if ts > now_ms.saturating_add(limits.max_future_skew_ms) {
        return invalid(format!(
            "{field} = {ts} is {} s ahead of the collector's clock (limit {} s)",
            (ts - now_ms) / 1000,
            limits.max_future_skew_ms / 1000
        ));
    }
    if ts < now_ms.saturating_sub(limits.max_age_ms) {
        return invalid(format!(
            "{field} = {ts} is older than {} h",
            limits.max_age_ms / 3_600_000
        ));
    }
    Ok(ts)
}

/// "{field} of {subject}" in an error message. Only a failed check formats
/// it: a valid batch, nearly every batch, formats nothing.
struct FieldOf<'a, S> {
    field: &'a str,
    subject: &'a S,
}

impl<S: fmt::Display> fmt::Display for FieldOf<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {}", self.field, self.subject)
    }
}

struct GpuSampleAt<'a>(&'a pb::GpuSample);

impl fmt::Display for GpuSampleAt<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {} at {}", self.0.uuid, self.0.timestamp_ms)
    }
}

struct ProcessOn<'a>(&'a pb::ProcessSample);

impl fmt::Display for ProcessOn<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} on {}", self.0.pid, self.0.uuid)
    }
}

fn device_id(session: &NodeSession, uuid: &str) -> Result<i64, Invalid> {
    session.device_ids.get(uuid).copied().ok_or_else(|| {
        Invalid(format!(
            "device {} is not in node {}'s registered inventory",
            Clipped(uuid),
            session.node
        ))
    })
}

/// Checks a batch from a registered agent and resolves its devices. The
/// batch's strings move into the rows (nothing is copied).
pub fn batch(
    b: pb::Batch,
    session: &NodeSession,
    now_ms: i64,
    limits: &Limits,
) -> Result<StoreBatch, Invalid> {
    if b.seq == 0 {
        return invalid("seq is 0; sequence numbers start at 1".into());
    }
    if i64::try_from(b.seq).is_err() {
        return invalid(format!(
            "seq {} is above 2^63 - 1, the most a stream can number",
            b.seq
        ));
    }
    let count = b.gpu_samples.len() + b.process_samples.len() + b.events.len();
    if count > limits.max_samples_per_batch {
        return invalid(format!(
            "{count} samples and events exceed the limit of {} per batch",
            limits.max_samples_per_batch
        ));
    }
    let mut gpu_samples = Vec::with_capacity(b.gpu_samples.len());
    let mut seen = HashSet::new();
    for s in &b.gpu_samples {
        let id = device_id(session, &s.uuid)?;
        let subject = GpuSampleAt(s);
        let at = |field| FieldOf {
            field,
            subject: &subject,
        };
        let ts = timestamp(at("timestamp_ms"), s.timestamp_ms, now_ms, limits)?;
        if !seen.insert((id, ts)) {
            return invalid(format!("device {} has two samples at {ts}", s.uuid));
        }
        let total = bytes(at("memory_total_bytes"), s.memory_total_bytes)?;
        let last = bytes(at("memory_used_last_bytes"), s.memory_used_last_bytes)?;
        let min = bytes(at("memory_used_min_bytes"), s.memory_used_min_bytes)?;
        let max = bytes(at("memory_used_max_bytes"), s.memory_used_max_bytes)?;
        let reserved = bytes(at("memory_reserved_bytes"), s.memory_reserved_bytes)?;
        if total == 0 {
            return invalid(format!("{} is 0", at("memory_total_bytes")));
        }
        if max > total {
            return invalid(format!(
                "{} = {max} exceeds memory_total_bytes = {total}",
                at("memory_used_max_bytes")
            ));
        }
        if !(min <= last && last <= max) {
            return invalid(format!(
                "{}: min {min}, last {last}, max {max} are not ordered min <= last <= max",
                at("memory used")
            ));
        }
        if reserved > total {
            return invalid(format!(
                "{} = {reserved} exceeds memory_total_bytes = {total}",
                at("memory_reserved_bytes")
            ));
        }
        let utilization = match s.utilization_pct {
            Some(u) if u > 100 => {
                return invalid(format!("{} = {u} is above 100", at("utilization_pct")));
            }
            Some(u) => Some(i16::try_from(u).unwrap_or(100)),
            None => None,
        };
        let rate = |field: &'static str, v: Option<u64>| v.map(|v| bytes(at(field), v)).transpose();
        gpu_samples.push(GpuSampleRow {
            device_id: id,
            timestamp_ms: ts,
            interval_ms: i32::try_from(s.interval_ms).unwrap_or(i32::MAX),
            poll_count: i32::try_from(s.poll_count).unwrap_or(i32::MAX),
            used_last: last,
            used_min: min,
            used_max: max,
            reserved,
            total,
            utilization_pct: utilization,
            pcie_tx_bytes_per_s: rate("pcie_tx_bytes_per_s", s.pcie_tx_bytes_per_s)?,
            pcie_rx_bytes_per_s: rate("pcie_rx_bytes_per_s", s.pcie_rx_bytes_per_s)?,
        });
    }
    let mut process_samples = Vec::with_capacity(b.process_samples.len());
    for p in b.process_samples {
        let id = device_id(session, &p.uuid)?;
        let subject = ProcessOn(&p);
        let at = |field| FieldOf {
            field,
            subject: &subject,
        };
        let ts = timestamp(at("timestamp_ms"), p.timestamp_ms, now_ms, limits)?;
        if p.pid == 0 {
            return invalid(format!("process on {} has pid 0", p.uuid));
        }
        check_text(at("name"), &p.name, limits.max_name_len, false)?;
        check_text(at("user"), &p.user, limits.max_id_len, false)?;
        check_text(
            at("container_id"),
            &p.container_id,
            limits.max_id_len,
            false,
        )?;
        check_text(at("pod_uid"), &p.pod_uid, limits.max_id_len, false)?;
        check_text(
            at("container_runtime"),
            &p.container_runtime,
            limits.max_id_len,
            false,
        )?;
        check_text(
            at("pod_qos_class"),
            &p.pod_qos_class,
            limits.max_id_len,
            false,
        )?;
        check_text(
            at("slurm_job_id"),
            &p.slurm_job_id,
            limits.max_id_len,
            false,
        )?;
        check_text(
            at("slurm_account"),
            &p.slurm_account,
            limits.max_id_len,
            false,
        )?;
        check_text(
            at("pod_namespace"),
            &p.pod_namespace,
            limits.max_id_len,
            false,
        )?;
        if p.pod_labels.len() > MAX_POD_LABELS {
            return invalid(format!(
                "{} has {} entries (limit {MAX_POD_LABELS})",
                at("pod_labels"),
                p.pod_labels.len()
            ));
        }
        let mut pod_labels: Vec<(String, String)> = Vec::with_capacity(p.pod_labels.len());
        for (key, value) in &p.pod_labels {
            let valid_key = !key.is_empty()
                && key
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'));
            if !valid_key {
                return invalid(format!(
                    "{} key {} is not a Kubernetes label key",
                    at("pod_labels"),
                    Clipped(key)
                ));
            }
            check_text(at("pod_labels key"), key, limits.max_id_len, true)?;
            check_text(at("pod_labels value"), value, limits.max_id_len, false)?;
            pod_labels.push((key.clone(), value.clone()));
        }
        pod_labels.sort();
        let last = bytes(at("memory_used_last_bytes"), p.memory_used_last_bytes)?;
        let max = bytes(at("memory_used_max_bytes"), p.memory_used_max_bytes)?;
        if let Some(device) = session.devices.get(&id)
            && max > device.memory_total
        {
            return invalid(format!(
                "{} = {max} exceeds the device's memory_total_bytes = {}",
                at("memory_used_max_bytes"),
                device.memory_total
            ));
        }
        if last > max {
            return invalid(format!(
                "{}: last {last} is above max {max}",
                at("memory used")
            ));
        }
        if p.start_time_ms < 0 || p.start_time_ms > ts {
            return invalid(format!(
                "{} = {} is not before the sample's timestamp {ts}",
                at("start_time_ms"),
                p.start_time_ms
            ));
        }
        // Allocator figures come from the job itself, not from NVML: an
        // impossible one is dropped and logged, the sample is kept.
        let allocator = p.allocator.as_ref().and_then(|a| {
            allocator_row(at, a, now_ms, limits)
                .map_err(|error| tracing::warn!(node = %b.node, %error, "allocator stats dropped"))
                .ok()
        });
        process_samples.push(ProcessSampleRow {
            device_id: id,
            timestamp_ms: ts,
            pid: i64::from(p.pid),
            start_time_ms: p.start_time_ms,
            used_last: last,
            used_max: max,
            name: p.name,
            uid: i64::from(p.uid),
            user: p.user,
            container_id: p.container_id,
            container_runtime: p.container_runtime,
            pod_uid: p.pod_uid,
            pod_qos_class: p.pod_qos_class,
            slurm_job_id: p.slurm_job_id,
            pod_namespace: p.pod_namespace,
            slurm_account: p.slurm_account,
            process_group: p.process_group,
            pod_labels,
            allocator,
        });
    }
    let mut events = Vec::with_capacity(b.events.len());
    for e in b.events {
        let kind = match pb::EventKind::try_from(e.kind) {
            Ok(pb::EventKind::Xid) => "xid",
            Ok(pb::EventKind::GpuLost) => "gpu_lost",
            Ok(pb::EventKind::MigReconfigured) => "mig_reconfigured",
            Ok(pb::EventKind::ProcessStarted) => "process_started",
            Ok(pb::EventKind::ProcessExited) => "process_exited",
            Ok(pb::EventKind::NvmlHung) => "nvml_hung",
            Ok(pb::EventKind::NvmlInvalidData) => "nvml_invalid_data",
            Ok(pb::EventKind::Unspecified) | Err(_) => {
                return invalid(format!("event kind {} is not known", e.kind));
            }
        };
        let device = if e.uuid.is_empty() {
            None
        } else {
            Some(device_id(session, &e.uuid)?)
        };
        check_text("event detail", &e.detail, limits.max_name_len, false)?;
        events.push(EventRow {
            device_id: device,
            timestamp_ms: timestamp("event timestamp_ms", e.timestamp_ms, now_ms, limits)?,
            kind,
            code: i64::from(e.code),
            pid: i64::from(e.pid),
            detail: e.detail,
        });
    }
    Ok(StoreBatch {
        node_id: session.node_id,
        boot_id: b.boot_id,
        seq: b.seq,
        gpu_samples,
        process_samples,
        events,
    })
}

/// A process's own allocator counters: sizes that fit the reservation they
/// come from, taken at a sane time.
fn allocator_row<F: fmt::Display>(
    field: impl Fn(&'static str) -> F,
    a: &pb::AllocatorStats,
    now_ms: i64,
    limits: &Limits,
) -> Result<AllocatorRow, Invalid> {
    let reserved = bytes(field("allocator.reserved_bytes"), a.reserved_bytes)?;
    let allocated = bytes(field("allocator.allocated_bytes"), a.allocated_bytes)?;
    let active = bytes(field("allocator.active_bytes"), a.active_bytes)?;
    let inactive_split = bytes(
        field("allocator.inactive_split_bytes"),
        a.inactive_split_bytes,
    )?;
    for (name, value) in [
        ("allocator.allocated_bytes", allocated),
        ("allocator.active_bytes", active),
        ("allocator.inactive_split_bytes", inactive_split),
    ] {
        if value > reserved {
            return invalid(format!(
                "{} = {value} exceeds allocator.reserved_bytes = {reserved}",
                field(name)
            ));
        }
    }
    Ok(AllocatorRow {
        timestamp_ms: timestamp(
            field("allocator.timestamp_ms"),
            a.timestamp_ms,
            now_ms,
            limits,
        )?,
        allocated,
        reserved,
        active,
        inactive_split,
        peak_allocated: bytes(
            field("allocator.peak_allocated_bytes"),
            a.peak_allocated_bytes,
        )?,
        alloc_retries: bytes(field("allocator.alloc_retries"), a.alloc_retries)?,
        ooms: bytes(field("allocator.ooms"), a.ooms)?,
        composition: a
            .composition
            .as_ref()
            .and_then(|c| composition(&field, c, a.peak_allocated_bytes.max(a.allocated_bytes))),
    })
}

/// What the job counted in its own tensors. A figure that cannot be true
/// of the allocator report it rides on (more than the live tensors ever
/// held, or past what the store keeps) is dropped and named in the log;
/// the parts that fit, and the report itself, are kept.
fn composition<F: fmt::Display>(
    field: impl Fn(&'static str) -> F,
    c: &pb::MemoryComposition,
    peak_tensors: u64,
) -> Option<Composition> {
    let part = |name: &'static str, p: &Option<pb::CompositionPart>| {
        let p = p.as_ref()?;
        match bytes(field(name), p.bytes) {
            Ok(_) => Some(Part {
                bytes: p.bytes,
                dtype: Dtype::from_name(&p.dtype),
            }),
            Err(Invalid(error)) => {
                tracing::warn!(%error, "allocator composition part dropped");
                None
            }
        }
    };
    let counted = Composition {
        weights: part("allocator.composition.weights", &c.weights),
        gradients: part("allocator.composition.gradients", &c.gradients),
        optimizer_state: part("allocator.composition.optimizer_state", &c.optimizer_state),
    };
    let (kept, problems) = counted.checked(peak_tensors);
    for problem in problems {
        tracing::warn!(
            "{}: {problem}; dropped, the allocator's figures kept",
            field("allocator.composition")
        );
    }
    (!kept.is_empty()).then_some(kept)
}
