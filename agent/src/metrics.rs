//! The agent's Prometheus endpoint: the latest fast poll of every GPU, MIG
//! instance and process, and the agent's own health (polls, failures, queue).
//! Gauges show the newest poll, so a scrape never returns a stale cache.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use headroom_common::exposition::write_family;

use crate::metrics_dcgm::DcgmDevice;

use crate::outbox::LogStats;
use crate::source::{EventKind, Inventory, Poll};

#[derive(Debug, Clone)]
struct DeviceLabels {
    gpu: String,
    model: String,
    mig_profile: String,
    /// The same device as dcgm-exporter labels it.
    dcgm: DcgmDevice,
}

#[derive(Debug, Default)]
struct LastPoll {
    /// Shared with the sampler, not copied: a poll of 8 GPUs × 50 processes
    /// at 10 Hz would otherwise cost thousands of allocations a second.
    poll: Arc<Poll>,
    duration: Duration,
}

#[derive(Debug)]
pub struct AgentMetrics {
    node: String,
    /// Replaced when the inventory changes (a MIG reconfiguration).
    devices: RwLock<HashMap<String, DeviceLabels>>,
    last: Mutex<LastPoll>,
    events: Mutex<HashMap<EventKind, u64>>,
    /// The last XID per device UUID, for `DCGM_FI_DEV_XID_ERRORS`.
    last_xid: Mutex<HashMap<String, u32>>,
    /// Also render dcgm-exporter's names (`dcgm_metric_names`).
    dcgm_names: AtomicBool,
    polls: AtomicU64,
    poll_failures: AtomicU64,
    pending_batches: AtomicU64,
    accepted_batches: AtomicU64,
    dropped_batches: AtomicU64,
    spool_bytes: AtomicU64,
    spool_segments: AtomicU64,
    spool_corrupt_segments: AtomicU64,
    outbox_failures: AtomicU64,
    allocator_outcomes: [AtomicU64; AllocatorOutcome::ALL.len()],
    allocator_clients: AtomicU64,
    /// 1 while the allocator socket listens, 0 when it could not be opened.
    allocator_socket_up: AtomicU64,
}

/// What became of one line (or connection) on the allocator socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocatorOutcome {
    Accepted,
    Malformed,
    /// The report named a pid the connection does not belong to, or the
    /// kernel gave no pid for the sender.
    WrongPid,
    RateLimited,
    TooLong,
    /// A connection beyond the client limit.
    RefusedClient,
}

impl AllocatorOutcome {
    const ALL: [Self; 6] = [
        Self::Accepted,
        Self::Malformed,
        Self::WrongPid,
        Self::RateLimited,
        Self::TooLong,
        Self::RefusedClient,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Malformed => "malformed",
            Self::WrongPid => "wrong_pid",
            Self::RateLimited => "rate_limited",
            Self::TooLong => "too_long",
            Self::RefusedClient => "refused_client",
        }
    }
}

/// Prometheus label values escape backslash, double quote and newline.
pub(crate) fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl AgentMetrics {
    pub fn new(node: &str, inventory: &Inventory) -> Arc<Self> {
        Arc::new(Self {
            node: node.to_owned(),
            devices: RwLock::new(labels_of(inventory)),
            last: Mutex::default(),
            events: Mutex::default(),
            last_xid: Mutex::default(),
            dcgm_names: AtomicBool::new(false),
            polls: AtomicU64::new(0),
            poll_failures: AtomicU64::new(0),
            pending_batches: AtomicU64::new(0),
            accepted_batches: AtomicU64::new(0),
            dropped_batches: AtomicU64::new(0),
            spool_bytes: AtomicU64::new(0),
            spool_segments: AtomicU64::new(0),
            spool_corrupt_segments: AtomicU64::new(0),
            outbox_failures: AtomicU64::new(0),
            allocator_outcomes: Default::default(),
            allocator_clients: AtomicU64::new(0),
            allocator_socket_up: AtomicU64::new(0),
        })
    }

    /// Renders dcgm-exporter's names beside Headroom's from now on.
    pub fn set_dcgm_names(&self, on: bool) {
        self.dcgm_names.store(on, Ordering::Relaxed);
    }

    pub fn record_allocator(&self, outcome: AllocatorOutcome) {
        self.allocator_outcomes[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn allocator_client_connected(&self, connected: bool) {
        if connected {
            self.allocator_clients.fetch_add(1, Ordering::Relaxed);
        } else {
            self.allocator_clients.fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub fn set_allocator_socket_up(&self, up: bool) {
        self.allocator_socket_up
            .store(u64::from(up), Ordering::Relaxed);
    }

    pub fn record_poll(&self, poll: &Arc<Poll>, duration: Duration) {
        self.polls.fetch_add(1, Ordering::Relaxed);
        if let Some(inventory) = &poll.inventory
            && let Ok(mut devices) = self.devices.write()
        {
            *devices = labels_of(inventory);
        }
        if !poll.events.is_empty()
            && let Ok(mut events) = self.events.lock()
        {
            for event in &poll.events {
                *events.entry(event.kind).or_default() += 1;
            }
        }
        if poll
            .events
            .iter()
            .any(|e| e.kind == EventKind::Xid && !e.device_uuid.is_empty())
            && let Ok(mut last_xid) = self.last_xid.lock()
        {
            for event in poll.events.iter().filter(|e| e.kind == EventKind::Xid) {
                last_xid.insert(event.device_uuid.clone(), event.code);
            }
        }
        if let Ok(mut last) = self.last.lock() {
            last.poll = poll.clone();
            last.duration = duration;
        }
    }

    /// Whether a GPU read has succeeded since the agent started.
    pub fn has_read_gpus(&self) -> bool {
        self.polls.load(Ordering::Relaxed) > 0
    }

    /// Polls attempted, failed ones included.
    pub fn sampler_turns(&self) -> u64 {
        self.polls.load(Ordering::Relaxed) + self.poll_failures.load(Ordering::Relaxed)
    }

    pub fn record_poll_failure(&self) {
        self.poll_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_outbox(&self, pending: u64, accepted: usize, dropped_total: u64, stats: LogStats) {
        self.pending_batches.store(pending, Ordering::Relaxed);
        self.accepted_batches
            .store(accepted as u64, Ordering::Relaxed);
        self.dropped_batches.store(dropped_total, Ordering::Relaxed);
        self.spool_bytes.store(stats.bytes, Ordering::Relaxed);
        self.spool_segments.store(stats.segments, Ordering::Relaxed);
        self.spool_corrupt_segments
            .store(stats.corrupt_segments, Ordering::Relaxed);
    }

    /// An interval that could not be queued (the spool could not be written).
    pub fn record_outbox_failure(&self) {
        self.outbox_failures.fetch_add(1, Ordering::Relaxed);
    }

    fn device_labels(&self, devices: &HashMap<String, DeviceLabels>, uuid: &str) -> String {
        let d = devices.get(uuid);
        format!(
            "node=\"{}\",gpu=\"{}\",uuid=\"{}\",model=\"{}\",mig_profile=\"{}\"",
            escape(&self.node),
            d.map_or("", |d| d.gpu.as_str()),
            escape(uuid),
            escape(d.map_or("", |d| d.model.as_str())),
            escape(d.map_or("", |d| d.mig_profile.as_str())),
        )
    }

    /// The Prometheus text exposition format, version 0.0.4.
    pub fn render(&self) -> String {
        let (poll, duration) = match self.last.lock() {
            Ok(last) => (last.poll.clone(), last.duration),
            Err(_) => (Arc::new(Poll::default()), Duration::ZERO),
        };
        let devices = self.devices.read().map(|d| d.clone()).unwrap_or_default();
        let devices = &devices;
        let mut out = String::with_capacity(4096);
        let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, String)>| {
            write_family(&mut out, name, kind, help, rows);
        };
        let per_device = |f: &dyn Fn(&crate::source::DeviceReading) -> Option<String>| {
            poll.devices
                .iter()
                .filter_map(|d| f(d).map(|v| (self.device_labels(devices, &d.uuid), v)))
                .collect::<Vec<_>>()
        };
        family(
            "headroom_gpu_memory_used_bytes",
            "gauge",
            "Memory in use at the latest poll, per GPU or MIG instance (excludes reserved).",
            per_device(&|d| Some(d.memory_used.to_string())),
        );
        family(
            "headroom_gpu_memory_reserved_bytes",
            "gauge",
            "Memory the driver reserves, per GPU.",
            per_device(&|d| Some(d.memory_reserved.to_string())),
        );
        family(
            "headroom_gpu_memory_total_bytes",
            "gauge",
            "Total memory, per GPU or MIG instance.",
            per_device(&|d| Some(d.memory_total.to_string())),
        );
        family(
            "headroom_gpu_utilization_ratio",
            "gauge",
            "Compute utilisation at the latest poll, 0 to 1 (absent on MIG instances).",
            per_device(&|d| {
                d.utilization_pct
                    .map(|u| format!("{}", f64::from(u) / 100.0))
            }),
        );
        family(
            "headroom_gpu_pcie_tx_bytes_per_second",
            "gauge",
            "PCIe transmit rate.",
            per_device(&|d| d.pcie_tx_bytes_per_s.map(|v| v.to_string())),
        );
        family(
            "headroom_gpu_pcie_rx_bytes_per_second",
            "gauge",
            "PCIe receive rate.",
            per_device(&|d| d.pcie_rx_bytes_per_s.map(|v| v.to_string())),
        );
        family(
            "headroom_process_memory_used_bytes",
            "gauge",
            "Memory a process holds on a GPU or MIG instance at the latest poll.",
            poll.processes
                .iter()
                .map(|p| {
                    (
                        format!(
                            "{},pid=\"{}\",process=\"{}\",user=\"{}\",job=\"{}\",pod=\"{}\",container=\"{}\"",
                            self.device_labels(devices, &p.device_uuid),
                            p.pid,
                            escape(&p.owner.name.chars().take(120).collect::<String>()),
                            escape(&p.owner.user),
                            escape(&p.owner.slurm_job_id),
                            escape(&p.owner.pod_uid),
                            escape(&p.owner.container_id),
                        ),
                        p.memory_used.to_string(),
                    )
                })
                .collect(),
        );
        family(
            "headroom_gpu_stalled",
            "gauge",
            "1 while an NVML call for this GPU has not returned within the watchdog's limit; its other gauges are then missing.",
            poll.stalled
                .iter()
                .map(|uuid| (self.device_labels(devices, uuid), "1".to_owned()))
                .collect(),
        );
        let node = format!("node=\"{}\"", escape(&self.node));
        let counts = self.events.lock().map(|e| e.clone()).unwrap_or_default();
        // Every kind from the start, at 0: a series that appears only with
        // its first event at 1 shows no increase() to Prometheus.
        let mut events: Vec<(String, String)> = EVENT_KINDS
            .iter()
            .map(|kind| {
                (
                    format!("{node},kind=\"{}\"", event_kind_label(*kind)),
                    counts.get(kind).copied().unwrap_or(0).to_string(),
                )
            })
            .collect();
        events.sort();
        family(
            "headroom_agent_events_total",
            "counter",
            "Hardware events seen: XID errors, lost GPUs, hung NVML calls, MIG reconfigurations, impossible NVML data.",
            events,
        );
        family(
            "headroom_agent_polls_total",
            "counter",
            "GPU polls completed.",
            vec![(node.clone(), self.polls.load(Ordering::Relaxed).to_string())],
        );
        family(
            "headroom_agent_poll_failures_total",
            "counter",
            "GPU polls that failed.",
            vec![(
                node.clone(),
                self.poll_failures.load(Ordering::Relaxed).to_string(),
            )],
        );
        family(
            "headroom_agent_poll_duration_seconds",
            "gauge",
            "How long the latest poll took.",
            vec![(node.clone(), format!("{}", duration.as_secs_f64()))],
        );
        family(
            "headroom_agent_pending_batches",
            "gauge",
            "Batches the collector has not yet made durable, sent or not; the agent keeps them until it has.",
            vec![(
                node.clone(),
                self.pending_batches.load(Ordering::Relaxed).to_string(),
            )],
        );
        family(
            "headroom_agent_accepted_batches",
            "gauge",
            "Of the pending batches, those the collector took in and holds in memory until its next flush.",
            vec![(
                node.clone(),
                self.accepted_batches.load(Ordering::Relaxed).to_string(),
            )],
        );
        family(
            "headroom_agent_dropped_batches_total",
            "counter",
            "Batches dropped: queue full while the collector was away, or rejected by it.",
            vec![(
                node.clone(),
                self.dropped_batches.load(Ordering::Relaxed).to_string(),
            )],
        );
        for (name, kind, help, value) in [
            (
                "headroom_agent_spool_bytes",
                "gauge",
                "Bytes of the disk spool's segments (0 without a spool).",
                &self.spool_bytes,
            ),
            (
                "headroom_agent_spool_segments",
                "gauge",
                "Segment files in the disk spool.",
                &self.spool_segments,
            ),
            (
                "headroom_agent_spool_corrupt_segments_total",
                "counter",
                "Spool segments found damaged (bad checksum, bad head); the rest of each was skipped.",
                &self.spool_corrupt_segments,
            ),
            (
                "headroom_agent_outbox_write_failures_total",
                "counter",
                "Intervals lost because they could not be queued (the spool could not be written).",
                &self.outbox_failures,
            ),
        ] {
            family(
                name,
                kind,
                help,
                vec![(node.clone(), value.load(Ordering::Relaxed).to_string())],
            );
        }
        family(
            "headroom_agent_allocator_reports_total",
            "counter",
            "Lines on the allocator socket by outcome: accepted, malformed, wrong_pid (claims another process), rate_limited, too_long; refused_client counts connections past the client limit.",
            AllocatorOutcome::ALL
                .iter()
                .map(|o| {
                    (
                        format!("{node},outcome=\"{}\"", o.label()),
                        self.allocator_outcomes[*o as usize]
                            .load(Ordering::Relaxed)
                            .to_string(),
                    )
                })
                .collect(),
        );
        family(
            "headroom_agent_allocator_clients",
            "gauge",
            "Processes connected to the allocator socket.",
            vec![(
                node.clone(),
                self.allocator_clients.load(Ordering::Relaxed).to_string(),
            )],
        );
        family(
            "headroom_agent_allocator_socket_up",
            "gauge",
            "1 while the allocator socket listens; 0 when it is off or could not be opened.",
            vec![(
                node,
                self.allocator_socket_up.load(Ordering::Relaxed).to_string(),
            )],
        );
        if self.dcgm_names.load(Ordering::Relaxed) {
            let dcgm: HashMap<String, DcgmDevice> = devices
                .iter()
                .map(|(uuid, d)| (uuid.clone(), d.dcgm.clone()))
                .collect();
            let last_xid = self.last_xid.lock().map(|x| x.clone()).unwrap_or_default();
            crate::metrics_dcgm::render(&mut out, &self.node, &dcgm, &poll, &last_xid);
        }
        out
    }
}

fn labels_of(inventory: &Inventory) -> HashMap<String, DeviceLabels> {
    let mut devices = HashMap::new();
    for gpu in &inventory.gpus {
        devices.insert(
            gpu.uuid.clone(),
            DeviceLabels {
                gpu: gpu.index.to_string(),
                model: gpu.name.clone(),
                mig_profile: String::new(),
                dcgm: DcgmDevice {
                    gpu: gpu.index,
                    gpu_uuid: gpu.uuid.clone(),
                    pci_bus_id: gpu.pci_bus_id.clone(),
                    model: gpu.name.clone(),
                    mig: None,
                    driver_version: inventory.driver_version.clone(),
                },
            },
        );
        for mig in &gpu.mig_instances {
            devices.insert(
                mig.uuid.clone(),
                DeviceLabels {
                    gpu: gpu.index.to_string(),
                    model: gpu.name.clone(),
                    mig_profile: mig.profile.clone(),
                    dcgm: DcgmDevice {
                        gpu: gpu.index,
                        gpu_uuid: gpu.uuid.clone(),
                        pci_bus_id: gpu.pci_bus_id.clone(),
                        model: gpu.name.clone(),
                        mig: Some((mig.profile.clone(), mig.gpu_instance_id)),
                        driver_version: inventory.driver_version.clone(),
                    },
                },
            );
        }
    }
    devices
}

const EVENT_KINDS: [EventKind; 5] = [
    EventKind::Xid,
    EventKind::GpuLost,
    EventKind::MigReconfigured,
    EventKind::NvmlHung,
    EventKind::NvmlInvalidData,
];

fn event_kind_label(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Xid => "xid",
        EventKind::GpuLost => "gpu_lost",
        EventKind::MigReconfigured => "mig_reconfigured",
        EventKind::NvmlHung => "nvml_hung",
        EventKind::NvmlInvalidData => "nvml_invalid_data",
    }
}

/// Serves `/metrics`, `/healthz` (the process lives) and `/readyz` (it has
/// read the GPUs once) on `listener` until the task is dropped.
pub fn serve(
    metrics: Arc<AgentMetrics>,
    listener: std::net::TcpListener,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let readiness = metrics.clone();
    let app = Router::new()
        .route(
            "/readyz",
            get(move || {
                let ready = readiness.has_read_gpus();
                async move {
                    if ready {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "not ready: no GPU read has succeeded yet\n",
                        )
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                        .into_response()
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }));
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "metrics endpoint failed");
        }
    });
    Ok((addr, task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{DeviceReading, GpuDevice, ProcessOwner, ProcessReading};

    #[test]
    fn is_ready_only_once_a_gpu_read_succeeded() {
        let inventory = Inventory {
            driver_version: "550".into(),
            gpus: vec![],
        };
        let m = AgentMetrics::new("node-1", &inventory);
        m.record_poll_failure();
        assert!(!m.has_read_gpus(), "a failed read is not a read");
        m.record_poll(&Arc::new(Poll::default()), Duration::from_millis(1));
        assert!(m.has_read_gpus());
    }

    #[test]
    fn dcgm_names_appear_only_when_asked_with_dcgm_labels_and_units() {
        const MIB: u64 = 1024 * 1024;
        let inventory = Inventory {
            driver_version: "550".into(),
            gpus: vec![GpuDevice {
                index: 2,
                uuid: "GPU-p".into(),
                name: "NVIDIA A100-SXM4-80GB".into(),
                memory_total: 80 * 1024 * MIB,
                pci_bus_id: "00000000:01:00.0".into(),
                pcie_generation: 4,
                pcie_width: 16,
                mig_instances: vec![crate::source::MigDevice {
                    uuid: "MIG-m".into(),
                    gpu_instance_id: 5,
                    compute_instance_id: 0,
                    profile: "3g.40gb".into(),
                    memory_total: 40 * 1024 * MIB,
                }],
            }],
        };
        let reading = |uuid: &str, used_mib: u64, total_mib: u64| DeviceReading {
            uuid: uuid.into(),
            memory_used: used_mib * MIB + 1,
            memory_reserved: 2 * MIB,
            memory_total: total_mib * MIB,
            utilization_pct: Some(37),
            pcie_tx_bytes_per_s: Some(1000),
            pcie_rx_bytes_per_s: None,
            health: None,
        };
        let mut xid =
            crate::source::SourceEvent::now(EventKind::Xid, "GPU-p".into(), String::new());
        xid.code = 79;
        let m = AgentMetrics::new("gpu-a01", &inventory);
        m.record_poll(
            &Arc::new(Poll {
                devices: vec![
                    DeviceReading {
                        health: Some(crate::source::GpuHealth {
                            temperature_c: Some(61),
                            power_mw: Some(312_345),
                            sm_clock_mhz: None,
                        }),
                        ..reading("GPU-p", 1000, 80 * 1024)
                    },
                    reading("MIG-m", 300, 40 * 1024),
                ],
                events: vec![xid],
                ..Poll::default()
            }),
            Duration::from_millis(1),
        );
        assert!(!m.render().contains("DCGM_"), "off by default");
        m.set_dcgm_names(true);
        let text = m.render();
        let gpu = "gpu=\"2\",UUID=\"GPU-p\",pci_bus_id=\"00000000:01:00.0\",device=\"nvidia2\",modelName=\"NVIDIA A100-SXM4-80GB\"";
        let host = "Hostname=\"gpu-a01\",DCGM_FI_DRIVER_VERSION=\"550\"";
        let mig = format!("{gpu},GPU_I_PROFILE=\"3g.40gb\",GPU_I_ID=\"5\",{host}");
        for line in [
            format!("DCGM_FI_DEV_FB_USED{{{gpu},{host}}} 1000"),
            format!(
                "DCGM_FI_DEV_FB_FREE{{{gpu},{host}}} {}",
                80 * 1024 - 1000 - 2 - 1
            ),
            format!("DCGM_FI_DEV_FB_RESERVED{{{gpu},{host}}} 2"),
            format!("DCGM_FI_DEV_GPU_UTIL{{{gpu},{host}}} 37"),
            format!("DCGM_FI_PROF_PCIE_TX_BYTES{{{gpu},{host}}} 1000"),
            format!("DCGM_FI_DEV_XID_ERRORS{{{gpu},{host}}} 79"),
            format!("DCGM_FI_DEV_GPU_TEMP{{{gpu},{host}}} 61"),
            format!("DCGM_FI_DEV_POWER_USAGE{{{gpu},{host}}} 312.345"),
            format!("DCGM_FI_DEV_FB_USED{{{mig}}} 300"),
            format!("DCGM_FI_DEV_XID_ERRORS{{{mig}}} 79"),
        ] {
            assert!(text.contains(&line), "{line} missing:\n{text}");
        }
        assert!(
            !text.contains("DCGM_FI_PROF_PCIE_RX_BYTES{")
                && !text.contains("DCGM_FI_DEV_SM_CLOCK{"),
            "absent, not zero"
        );
        assert!(
            text.contains("headroom_gpu_memory_used_bytes{"),
            "Headroom's names stay"
        );
    }

    #[test]
    fn renders_the_latest_poll_with_escaped_labels() {
        let inventory = Inventory {
            driver_version: "550".into(),
            gpus: vec![GpuDevice {
                index: 3,
                uuid: "GPU-a".into(),
                name: "H100".into(),
                memory_total: 100,
                pci_bus_id: String::new(),
                pcie_generation: 5,
                pcie_width: 16,
                mig_instances: vec![],
            }],
        };
        let m = AgentMetrics::new("node-1", &inventory);
        m.record_poll(
            &Arc::new(Poll {
                devices: vec![DeviceReading {
                    uuid: "GPU-a".into(),
                    memory_used: 42,
                    memory_reserved: 1,
                    memory_total: 100,
                    utilization_pct: Some(50),
                    pcie_tx_bytes_per_s: None,
                    pcie_rx_bytes_per_s: Some(7),
                    health: None,
                }],
                processes: vec![ProcessReading {
                    device_uuid: "GPU-a".into(),
                    pid: 9,
                    start_time_ms: 0,
                    memory_used: 40,
                    owner: Arc::new(ProcessOwner {
                        name: "python \"train\".py".into(),
                        user: "alice".into(),
                        slurm_job_id: "7".into(),
                        ..ProcessOwner::default()
                    }),
                    allocator: None,
                }],
                ..Poll::default()
            }),
            Duration::from_millis(2),
        );
        let text = m.render();
        assert!(text.contains(
            "headroom_gpu_memory_used_bytes{node=\"node-1\",gpu=\"3\",uuid=\"GPU-a\",model=\"H100\",mig_profile=\"\"} 42"
        ), "{text}");
        assert!(text.contains("headroom_gpu_utilization_ratio{node=\"node-1\",gpu=\"3\",uuid=\"GPU-a\",model=\"H100\",mig_profile=\"\"} 0.5"));
        assert!(
            !text.contains("headroom_gpu_pcie_tx_bytes_per_second{"),
            "absent, not zero"
        );
        assert!(
            text.contains("process=\"python \\\"train\\\".py\""),
            "{text}"
        );
        assert!(text.contains("headroom_agent_polls_total{node=\"node-1\"} 1"));
        assert!(
            text.contains("headroom_agent_events_total{node=\"node-1\",kind=\"xid\"} 0"),
            "every kind from the start, so the first event is an increase: {text}"
        );
    }
}
