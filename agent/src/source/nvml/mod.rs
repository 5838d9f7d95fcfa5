//! The real source: NVIDIA's management library, loaded at run time through
//! nvml-wrapper.
//!
//! One thread ([`poller`]) makes every NVML call for all GPUs and their MIG
//! instances ([`gpu`]), under a [`watchdog`]: a poll wakes that one thread
//! and waits a bounded time for its answers. A GPU whose call runs past
//! `handoff_after` keeps that thread to itself and the other GPUs move to a
//! new one, so a call that hangs stalls only its GPU: it is reported once as
//! hung and then as stalled, a lost GPU once as lost, and the other GPUs go
//! on being read. XID errors come from an event set on their own thread
//! ([`events`]), PCIe fallback sampling likewise ([`pcie`]). Processes are
//! attributed to users, containers, pods and Slurm jobs from `/proc`
//! ([`crate::attribution`]).

mod events;
mod gpu;
mod mig;
mod pcie;
mod poller;
mod watchdog;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;

use crate::attribution::{Attribution, Attributor};
use crate::kubernetes::PodLabels;

use super::{
    EventKind, GpuDevice, GpuSource, Inventory, Poll, ProcessOwner, ProcessReading, SourceError,
    SourceEvent,
};
use gpu::{GpuReading, GpuReply, Outcome, RawProcess, ReadTiming};
use pcie::ThroughputBoard;
use poller::Answers;
use watchdog::Watchdog;

/// The system's NVML, as the driver installs it.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

#[derive(Debug, Clone)]
pub struct NvmlOptions {
    /// The libnvidia-ml to load; [`DEFAULT_LIBRARY`] from the loader's
    /// search path when `None`.
    pub library: Option<PathBuf>,
    /// Where to read processes' owners from (the host's `/proc`).
    pub procfs_root: PathBuf,
    /// Where the kubelet keeps pods' log directories (pods' namespaces).
    pub pod_log_dir: PathBuf,
    /// Pods' labels as the API server gives them, when forwarded.
    pub pod_labels: Option<Arc<PodLabels>>,
    /// An NVML call running longer than this is reported as hung.
    pub call_timeout: Duration,
    /// How long one poll waits for the GPUs' answers; an answer that comes
    /// later counts towards the next poll.
    pub poll_wait: Duration,
    /// A call that has run this long when a poll stops waiting keeps its
    /// GPU on its thread alone; the thread's other GPUs move to a new one.
    pub handoff_after: Duration,
    /// How often each GPU's layout (MIG instances) is re-read.
    pub layout_check: Duration,
    /// Cadence of `nvmlDeviceGetPcieThroughput` on GPUs without PCIe byte
    /// counters.
    pub pcie_fallback_interval: Duration,
    /// How long a process's owner is trusted before `/proc` is read again.
    pub attribution_refresh: Duration,
    /// Utilisation and graphics processes, which do not need 10 Hz, are read
    /// on one poll in this many (10: once a second at 10 Hz). Memory,
    /// compute processes and PCIe are read on every poll.
    pub slow_every: u64,
    /// Also read temperature, power draw and SM clock on the slow polls:
    /// only dcgm-exporter's names show them (`dcgm_metric_names`).
    pub read_health: bool,
}

impl Default for NvmlOptions {
    fn default() -> Self {
        Self {
            library: None,
            procfs_root: PathBuf::from("/proc"),
            pod_log_dir: PathBuf::from(crate::attribution::DEFAULT_POD_LOG_DIR),
            pod_labels: None,
            call_timeout: Duration::from_secs(5),
            poll_wait: Duration::from_millis(80),
            handoff_after: Duration::from_millis(40),
            layout_check: Duration::from_secs(10),
            pcie_fallback_interval: Duration::from_secs(1),
            attribution_refresh: Duration::from_secs(5),
            slow_every: 10,
            read_health: false,
        }
    }
}

pub struct NvmlSource {
    driver_version: String,
    nvml: Arc<Nvml>,
    board: Arc<ThroughputBoard>,
    timing: ReadTiming,
    gpus: Vec<Slot>,
    pollers: Vec<Poller>,
    replies: Arc<Mutex<Vec<GpuReply>>>,
    done_tx: Sender<usize>,
    done: Receiver<usize>,
    xid_events: Receiver<SourceEvent>,
    stop: Arc<AtomicBool>,
    options: NvmlOptions,
    attributor: Attributor,
    owners: HashMap<u32, Owner>,
    /// The owner of processes `/proc` could not tell about.
    nobody: Arc<ProcessOwner>,
    readings: Vec<GpuReading>,
    events: Vec<SourceEvent>,
    reported_invalid: HashSet<(String, u32)>,
    inventory_changed: bool,
    last_prune: Instant,
}

/// How often caches keyed by pid drop the pids NVML no longer lists.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

impl std::fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource")
            .field("driver_version", &self.driver_version)
            .field("gpus", &self.gpus.len())
            .field("threads", &self.pollers.len())
            .finish_non_exhaustive()
    }
}

/// The source's view of one GPU.
#[derive(Debug)]
struct Slot {
    index: u32,
    hung_reported: bool,
    layout: Option<GpuDevice>,
    failures: u64,
}

/// The source's view of one polling thread; its place in `pollers` is its
/// id.
#[derive(Debug)]
struct Poller {
    /// `None` once the thread has ended (its last GPU was lost).
    requests: Option<SyncSender<()>>,
    watchdog: Arc<Watchdog>,
    /// A request is out and not yet answered.
    busy: bool,
    /// Its call in flight was reported as hung.
    hung: bool,
}

impl Slot {
    /// The GPU's UUID; empty before its layout was first read.
    fn uuid(&self) -> String {
        self.layout
            .as_ref()
            .map(|l| l.uuid.clone())
            .unwrap_or_default()
    }
}

/// What `/proc` said about a pid, ready to hand out on every poll.
#[derive(Debug)]
struct Owner {
    owner: Arc<ProcessOwner>,
    start_time_ms: i64,
    checked: Instant,
}

impl NvmlSource {
    /// Loads NVML, starts the thread that reads the GPUs and reads every
    /// GPU's layout. A library that cannot be loaded is an error: the agent
    /// never falls back to anything else on its own.
    pub fn new(options: NvmlOptions) -> Result<Self, SourceError> {
        let library = options
            .library
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_LIBRARY));
        let nvml = Nvml::builder()
            .lib_path(library.as_os_str())
            .init()
            .map_err(|e| SourceError::NvmlLoad {
                library: library.display().to_string(),
                reason: e.to_string(),
            })?;
        let nvml = Arc::new(nvml);
        let driver_version = nvml.sys_driver_version().map_err(|e| SourceError::Nvml {
            call: "nvmlSystemGetDriverVersion",
            reason: e.to_string(),
        })?;
        let count = nvml.device_count().map_err(|e| SourceError::Nvml {
            call: "nvmlDeviceGetCount_v2",
            reason: e.to_string(),
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let board = Arc::new(ThroughputBoard::default());
        let timing = ReadTiming {
            layout_check: options.layout_check,
            slow_every: options.slow_every,
            read_health: options.read_health,
        };
        let gpus = (0..count)
            .map(|index| Slot {
                index,
                hung_reported: false,
                layout: None,
                failures: 0,
            })
            .collect();
        pcie::spawn_fallback(
            nvml.clone(),
            board.clone(),
            options.pcie_fallback_interval,
            stop.clone(),
        )?;
        let (xid_tx, xid_events) = mpsc::channel();
        events::spawn(nvml.clone(), (0..count).collect(), xid_tx, stop.clone())?;
        let attributor =
            Attributor::new(options.procfs_root.clone()).with_pod_log_dir(&options.pod_log_dir);
        let (done_tx, done) = mpsc::channel();
        let mut source = Self {
            driver_version,
            nvml,
            board,
            timing,
            gpus,
            pollers: Vec::new(),
            replies: Arc::new(Mutex::new(Vec::new())),
            done_tx,
            done,
            xid_events,
            stop,
            options,
            attributor,
            owners: HashMap::new(),
            nobody: Arc::new(ProcessOwner::default()),
            readings: Vec::new(),
            events: Vec::new(),
            reported_invalid: HashSet::new(),
            inventory_changed: false,
            last_prune: Instant::now(),
        };
        if count > 0 {
            source.start_poller((0..count).collect())?;
        }
        // The first round reads every layout; give it the watchdog's limit,
        // not a poll's, so a slow start is not mistaken for a missing GPU.
        source.request_round();
        source.collect_until(Instant::now() + source.options.call_timeout);
        source.isolate_stuck(source.options.call_timeout);
        source.report_hung();
        Ok(source)
    }

    /// Starts a polling thread for `gpus`.
    fn start_poller(&mut self, gpus: Vec<u32>) -> std::io::Result<()> {
        let id = self.pollers.len();
        let name = match (id, gpus.as_slice()) {
            (0, _) => "headroom-nvml".to_owned(),
            (_, [gpu]) => format!("headroom-nvml-gpu{gpu}"),
            _ => format!("headroom-nvml-{id}"),
        };
        let watchdog = Arc::new(Watchdog::new(gpus));
        let (requests, requests_rx) = mpsc::sync_channel(1);
        poller::spawn(
            name,
            self.nvml.clone(),
            watchdog.clone(),
            requests_rx,
            Answers {
                id,
                replies: self.replies.clone(),
                done: self.done_tx.clone(),
            },
            self.board.clone(),
            self.timing,
        )?;
        self.pollers.push(Poller {
            requests: Some(requests),
            watchdog,
            busy: false,
            hung: false,
        });
        Ok(())
    }

    /// A thread stuck in one GPU's call for at least `after` keeps that GPU;
    /// its other GPUs go to a new thread, read from the next poll on.
    fn isolate_stuck(&mut self, after: Duration) {
        for at in 0..self.pollers.len() {
            let poller = &self.pollers[at];
            if !poller.busy {
                continue;
            }
            let Some((stuck, others)) = poller.watchdog.isolate_stuck(after) else {
                continue;
            };
            let watchdog = poller.watchdog.clone();
            tracing::warn!(
                gpu = stuck.gpu,
                call = stuck.call,
                running_ms = stuck.since.elapsed().as_millis(),
                moved = ?others,
                "NVML call is slow; the other GPUs move to a thread of their own"
            );
            if let Err(error) = self.start_poller(others.clone()) {
                tracing::error!(%error, "cannot start a polling thread; the GPUs wait for the slow call");
                watchdog.restore(&others);
            }
        }
    }

    fn request_round(&mut self) {
        for poller in &mut self.pollers {
            if poller.busy {
                continue;
            }
            let Some(requests) = &poller.requests else {
                continue;
            };
            // The channel holds one request and the thread is idle, so this
            // only fails when the thread has ended.
            if requests.try_send(()).is_ok() {
                poller.busy = true;
            } else {
                poller.requests = None;
            }
        }
    }

    /// Waits until every thread that is not known to hang has read its
    /// GPUs, or `deadline`, then takes the readings.
    fn collect_until(&mut self, deadline: Instant) {
        loop {
            while let Ok(id) = self.done.try_recv() {
                self.finished(id);
            }
            let waiting = self.pollers.iter().any(|p| p.busy && !p.hung);
            let now = Instant::now();
            if !waiting || now >= deadline {
                break;
            }
            match self.done.recv_timeout(deadline - now) {
                Ok(id) => self.finished(id),
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
            }
        }
        let replies = match self.replies.lock() {
            Ok(mut replies) => std::mem::take(&mut *replies),
            Err(_) => Vec::new(),
        };
        for reply in replies {
            self.accept(reply);
        }
    }

    fn finished(&mut self, id: usize) {
        if let Some(poller) = self.pollers.get_mut(id) {
            poller.busy = false;
            poller.hung = false;
        }
    }

    fn accept(&mut self, reply: GpuReply) {
        let Some(slot) = self.gpus.iter_mut().find(|s| s.index == reply.index) else {
            return;
        };
        if slot.hung_reported {
            slot.hung_reported = false;
            tracing::info!(gpu = slot.index, "NVML answers again after a hung call");
        }
        match reply.outcome {
            Outcome::Reading(mut reading) => {
                slot.failures = 0;
                if let Some(layout) = reading.layout.take()
                    && slot.layout.as_ref() != Some(&layout)
                {
                    if let Some(old) = &slot.layout {
                        let detail = format!(
                            "MIG layout changed from [{}] to [{}]",
                            profiles(old),
                            profiles(&layout)
                        );
                        tracing::warn!(gpu = %layout.uuid, %detail, "MIG reconfigured");
                        self.events.push(SourceEvent::now(
                            EventKind::MigReconfigured,
                            layout.uuid.clone(),
                            detail,
                        ));
                    }
                    slot.layout = Some(layout);
                    self.inventory_changed = true;
                }
                self.readings.push(reading);
            }
            Outcome::Lost => {
                let uuid = slot.uuid();
                tracing::error!(gpu = slot.index, %uuid, "GPU lost (fallen off the bus); the others are still polled");
                self.events.push(SourceEvent::now(
                    EventKind::GpuLost,
                    uuid,
                    format!("GPU {} is lost (NVML_ERROR_GPU_IS_LOST)", slot.index),
                ));
            }
            Outcome::Failed { call, reason } => {
                slot.failures += 1;
                // Every poll fails the same way while a GPU is unwell; say it
                // once, then now and then.
                if slot.failures == 1 || slot.failures % 600 == 0 {
                    tracing::warn!(gpu = slot.index, call, %reason, failures = slot.failures, "NVML call failed");
                }
            }
        }
    }

    fn report_hung(&mut self) {
        for poller in &mut self.pollers {
            if !poller.busy {
                continue;
            }
            let Some(in_flight) = poller.watchdog.in_flight() else {
                continue;
            };
            let running = in_flight.since.elapsed();
            if running < self.options.call_timeout {
                continue;
            }
            poller.hung = true;
            let Some(slot) = self.gpus.iter_mut().find(|s| s.index == in_flight.gpu) else {
                continue;
            };
            if slot.hung_reported {
                continue;
            }
            let call = in_flight.call;
            slot.hung_reported = true;
            let uuid = slot.uuid();
            let detail = format!(
                "{call} on GPU {} has not returned for {:.1} s; its readings stop until it does",
                slot.index,
                running.as_secs_f64()
            );
            tracing::error!(gpu = slot.index, %uuid, call, "NVML call hung");
            self.events
                .push(SourceEvent::now(EventKind::NvmlHung, uuid, detail));
        }
    }

    fn current_inventory(&self) -> Inventory {
        Inventory {
            driver_version: self.driver_version.clone(),
            gpus: self.gpus.iter().filter_map(|s| s.layout.clone()).collect(),
        }
    }

    /// Who owns `pid`. `/proc` is read for a pid NVML has not listed
    /// before, and again every `attribution_refresh` (to catch pid reuse);
    /// in between, the last answer stands, which keeps polling at 10 Hz off
    /// the filesystem. A process gone from `/proc` by the time we look (or
    /// hidden by a pid namespace) is still reported, without an owner.
    fn owner(&mut self, pid: u32, now: Instant) -> (Arc<ProcessOwner>, i64) {
        if let Some(known) = self.owners.get(&pid)
            && now.duration_since(known.checked) < self.options.attribution_refresh
        {
            return (known.owner.clone(), known.start_time_ms);
        }
        let (owner, start_time_ms) = match self.attributor.attribute(pid) {
            Some(a) => (
                Arc::new(owner_of(&a, self.options.pod_labels.as_deref())),
                a.start_time_ms,
            ),
            None => (self.nobody.clone(), 0),
        };
        self.owners.insert(
            pid,
            Owner {
                owner: owner.clone(),
                start_time_ms,
                checked: now,
            },
        );
        (owner, start_time_ms)
    }

    fn process(&mut self, raw: RawProcess, now: Instant) -> ProcessReading {
        let (owner, start_time_ms) = self.owner(raw.pid, now);
        ProcessReading {
            device_uuid: raw.device_uuid,
            pid: raw.pid,
            start_time_ms,
            memory_used: raw.memory_used.unwrap_or(0),
            owner,
            allocator: None,
        }
    }
}

fn owner_of(a: &Attribution, pod_labels: Option<&PodLabels>) -> ProcessOwner {
    // Looked up at each refresh, not cached with the attribution: a pod's
    // labels may arrive after its first process does.
    let labels = match (&a.pod, pod_labels) {
        (Some(pod), Some(labels)) => labels.of(&pod.uid).to_vec(),
        _ => Vec::new(),
    };
    ProcessOwner {
        pod_labels: labels,
        name: a.command.clone(),
        uid: a.uid,
        user: a.user.clone(),
        container_id: a
            .container
            .as_ref()
            .map(|c| c.id.clone())
            .unwrap_or_default(),
        container_runtime: a
            .container
            .as_ref()
            .map(|c| c.runtime.label().to_owned())
            .unwrap_or_default(),
        pod_uid: a.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default(),
        pod_qos_class: a
            .pod
            .as_ref()
            .and_then(|p| p.qos.as_ref())
            .map(|q| q.label().to_owned())
            .unwrap_or_default(),
        pod_namespace: a.pod_namespace.clone().unwrap_or_default(),
        slurm_job_id: a.slurm_job_id.clone().unwrap_or_default(),
        slurm_account: a.slurm_account.clone().unwrap_or_default(),
        process_group: a.process_group.unwrap_or(0),
    }
}

impl GpuSource for NvmlSource {
    fn inventory(&mut self) -> Result<Inventory, SourceError> {
        self.inventory_changed = false;
        Ok(self.current_inventory())
    }

    fn poll(&mut self) -> Result<Poll, SourceError> {
        self.request_round();
        self.collect_until(Instant::now() + self.options.poll_wait);
        self.isolate_stuck(self.options.handoff_after);
        self.report_hung();
        let now = Instant::now();
        let mut poll = Poll::default();
        // Forgetting exited processes needs the full pid list; once a
        // second is plenty, and spares hundreds of hash operations per poll.
        let prune = now.duration_since(self.last_prune) >= PRUNE_EVERY;
        let mut live = HashSet::new();
        for reading in std::mem::take(&mut self.readings) {
            poll.devices.extend(reading.devices);
            for invalid in reading.invalid {
                // Once per device and pid: the same impossible answer at
                // 10 Hz is one problem, not thousands.
                if self.reported_invalid.len() > 10_000 {
                    self.reported_invalid.clear();
                }
                if self
                    .reported_invalid
                    .insert((invalid.device_uuid.clone(), invalid.pid))
                {
                    tracing::warn!(gpu = %invalid.device_uuid, detail = %invalid.detail, "NVML returned impossible data; not stored");
                    self.events.push(SourceEvent {
                        pid: invalid.pid,
                        ..SourceEvent::now(
                            EventKind::NvmlInvalidData,
                            invalid.device_uuid,
                            invalid.detail,
                        )
                    });
                }
            }
            for raw in reading.processes {
                if prune {
                    live.insert(raw.pid);
                }
                let process = self.process(raw, now);
                poll.processes.push(process);
            }
        }
        if prune {
            self.last_prune = now;
            self.owners.retain(|pid, _| live.contains(pid));
            self.attributor.retain(live.iter().copied());
        }
        while let Ok(event) = self.xid_events.try_recv() {
            self.events.push(event);
        }
        poll.events = std::mem::take(&mut self.events);
        if self.inventory_changed {
            self.inventory_changed = false;
            poll.inventory = Some(self.current_inventory());
        }
        poll.stalled = self
            .gpus
            .iter()
            .filter(|s| s.hung_reported)
            .filter_map(|s| s.layout.as_ref().map(|l| l.uuid.clone()))
            .collect();
        Ok(poll)
    }
}

impl Drop for NvmlSource {
    fn drop(&mut self) {
        // Threads end when their request channel closes or on `stop`; a
        // thread stuck in a hung call is left behind rather than joined.
        self.stop.store(true, Ordering::Relaxed);
        for poller in &mut self.pollers {
            poller.requests = None;
        }
    }
}

fn profiles(gpu: &GpuDevice) -> String {
    gpu.mig_instances
        .iter()
        .map(|m| m.profile.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}
