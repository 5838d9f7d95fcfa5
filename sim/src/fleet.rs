//! Evaluates a node at an instant. Everything is a pure function of the
//! scenario and `t`: jitter comes from hashing (seed, node, GPU, pid, tick),
//! so two evaluations of the same instant always agree, whichever process,
//! thread or machine does them.

use std::f64::consts::{PI, TAU};

use crate::ids::StableHash;
use headroom_common::{Composition, Part};

use crate::model::{CompositionModel, Gpu, MigInstance, NodeSpec, Process};
use crate::shape::Footprint;
use crate::state::{AllocatorSnapshot, GpuInfo, GpuState, MigInfo, MigState, ProcessState};

/// Jitter changes ten times a second: fast enough to look alive to a
/// sub-second poller, slow enough that two reads in one poll agree.
const JITTER_TICKS_PER_S: f64 = 10.0;
const DEFAULT_BUSY_UTILIZATION_PCT: u32 = 60;
const UTILIZATION_JITTER_PCT: f64 = 5.0;
/// PCIe traffic swings ±30 % around its mean over a one-minute cycle.
const PCIE_SWING: f64 = 0.3;
/// An idle data-centre GPU's temperature, and how far full load lifts it.
const IDLE_TEMPERATURE_C: f64 = 32.0;
const LOAD_TEMPERATURE_RISE_C: f64 = 40.0;
/// An H100 SXM's idle draw and board limit, in milliwatts.
const IDLE_POWER_MW: f64 = 70_000.0;
const MAX_POWER_MW: f64 = 700_000.0;
/// SM clocks at idle and under load (an H100's base and boost).
const IDLE_SM_CLOCK_MHZ: u32 = 345;
const BUSY_SM_CLOCK_MHZ: u32 = 1_980;
const PCIE_PERIOD_S: f64 = 60.0;
const PCIE_WIDTH: u32 = 16;

impl NodeSpec {
    pub fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    /// The node's GPUs, ordered by index.
    pub fn inventory(&self) -> Vec<GpuInfo> {
        self.gpus
            .iter()
            .map(|gpu| GpuInfo {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                name: gpu.model.clone(),
                memory_total: gpu.memory_total,
                pci_bus_id: format!("00000000:{:02X}:00.0", pci_bus(gpu.index)),
                pcie_generation: gpu.pcie_generation(),
                pcie_width: PCIE_WIDTH,
                mig: gpu.mig.iter().map(mig_info).collect(),
            })
            .collect()
    }

    /// Readings `t` seconds after the scenario started, one per GPU in
    /// inventory order. Before time zero nothing is running.
    pub fn state_at(&self, t: f64) -> Vec<GpuState> {
        self.gpus
            .iter()
            .map(|gpu| GpuInstant::new(self, gpu, t).state())
            .collect()
    }
}

/// The PCI bus a GPU sits on: one per GPU from bus 1, as a simple board
/// numbers them.
fn pci_bus(index: u32) -> u32 {
    (index + 1) & 0xff
}

fn mig_info(instance: &MigInstance) -> MigInfo {
    MigInfo {
        uuid: instance.uuid.clone(),
        gpu_instance_id: instance.gpu_instance_id,
        compute_instance_id: instance.compute_instance_id,
        profile: instance.profile.clone(),
        memory_total: instance.memory_total,
    }
}

/// One GPU at one instant, with the noise sources keyed to both.
struct GpuInstant<'a> {
    node: &'a NodeSpec,
    gpu: &'a Gpu,
    t: f64,
    tick: i64,
}

impl<'a> GpuInstant<'a> {
    fn new(node: &'a NodeSpec, gpu: &'a Gpu, t: f64) -> Self {
        Self {
            node,
            gpu,
            t,
            // Saturating float→int cast: absurd `t` still gives some tick.
            tick: (t * JITTER_TICKS_PER_S).floor() as i64,
        }
    }

    fn key(&self, stream: &str, pid: u32) -> StableHash {
        StableHash::new(stream)
            .u64(self.node.seed)
            .str(&self.node.name)
            .u64(u64::from(self.gpu.index))
            .u64(u64::from(pid))
    }

    /// Noise in `[-1, 1)` that changes every jitter tick.
    fn jitter(&self, stream: &str, pid: u32) -> f64 {
        self.key(stream, pid).i64(self.tick).signed_unit()
    }

    fn state(&self) -> GpuState {
        let gpu = self.gpu;
        let processes = self.device_processes(&gpu.processes, gpu.process_capacity());
        let mig: Vec<MigState> = gpu.mig.iter().map(|m| self.mig_state(m)).collect();

        let attributed = total_memory(&processes).saturating_add(
            mig.iter()
                .map(|m| m.memory_used)
                .fold(0, u64::saturating_add),
        );
        let memory_used = attributed
            .saturating_add(gpu.unattributed)
            .min(gpu.memory_total.saturating_sub(gpu.reserved));
        let busy = !processes.is_empty() || mig.iter().any(|m| !m.processes.is_empty());

        let utilization_pct = if busy { self.busy_utilization() } else { 0 };
        let load = f64::from(utilization_pct) / 100.0;
        GpuState {
            uuid: gpu.uuid.clone(),
            memory_used,
            memory_reserved: gpu.reserved,
            memory_total: gpu.memory_total,
            utilization_pct,
            pcie_tx_bytes_per_s: self.pcie_rate("pcie-tx", gpu.pcie_tx),
            pcie_rx_bytes_per_s: self.pcie_rate("pcie-rx", gpu.pcie_rx),
            temperature_c: (IDLE_TEMPERATURE_C + LOAD_TEMPERATURE_RISE_C * load).round() as u32,
            power_mw: (IDLE_POWER_MW + (MAX_POWER_MW - IDLE_POWER_MW) * load).round() as u32,
            sm_clock_mhz: if busy {
                BUSY_SM_CLOCK_MHZ
            } else {
                IDLE_SM_CLOCK_MHZ
            },
            processes,
            mig,
        }
    }

    fn mig_state(&self, instance: &MigInstance) -> MigState {
        let processes = self.device_processes(&instance.processes, instance.memory_total);
        MigState {
            uuid: instance.uuid.clone(),
            memory_used: total_memory(&processes).min(instance.memory_total),
            memory_total: instance.memory_total,
            processes,
        }
    }

    fn busy_utilization(&self) -> u32 {
        let configured = self
            .gpu
            .utilization_pct
            .unwrap_or(DEFAULT_BUSY_UTILIZATION_PCT);
        let wobble = UTILIZATION_JITTER_PCT * self.jitter("utilization", 0);
        (f64::from(configured) + wobble).round().clamp(0.0, 100.0) as u32
    }

    fn pcie_rate(&self, stream: &str, mean: u64) -> u64 {
        if mean == 0 {
            return 0;
        }
        // A fixed phase per GPU and direction, so a fleet's GPUs don't all
        // peak together.
        let phase = PI * self.key(stream, 0).signed_unit();
        let factor = 1.0 + PCIE_SWING * (TAU * self.t / PCIE_PERIOD_S + phase).sin();
        let rate = mean as f64 * factor;
        if rate.is_finite() {
            rate.round() as u64
        } else {
            0
        }
    }

    /// The processes alive on one device (a whole GPU or one MIG instance)
    /// that offers `capacity` bytes to processes.
    ///
    /// OOM-prone processes are placed last: the room each one has is the
    /// capacity minus what every other process holds at `t`, where other
    /// OOM-prone processes count at their starting footprint. Using values
    /// at `t` rather than at the (unknown) moment of the OOM is the
    /// approximation that keeps this O(processes) per evaluation.
    fn device_processes(&self, processes: &[Process], capacity: u64) -> Vec<ProcessState> {
        let alive: Vec<(&Process, f64)> = processes
            .iter()
            .filter_map(|p| p.elapsed_at(self.t).map(|elapsed| (p, elapsed)))
            .collect();
        let noise = |p: &Process| self.jitter("process-memory", p.pid);

        let mut footprints: Vec<Option<Footprint>> = alive
            .iter()
            .map(|(p, elapsed)| {
                (!p.memory.is_oom_prone())
                    .then(|| p.memory.sample(*elapsed, noise(p), u64::MAX))
                    .flatten()
            })
            .collect();
        let settled = footprints
            .iter()
            .flatten()
            .map(|f| f.bytes)
            .fold(0, u64::saturating_add);
        let oom_prone_floors = alive
            .iter()
            .filter(|(p, _)| p.memory.is_oom_prone())
            .map(|(p, _)| p.memory.floor_bytes())
            .fold(0, u64::saturating_add);

        for ((process, elapsed), footprint) in alive.iter().zip(footprints.iter_mut()) {
            if process.memory.is_oom_prone() {
                let neighbours = oom_prone_floors.saturating_sub(process.memory.floor_bytes());
                let room = capacity.saturating_sub(settled).saturating_sub(neighbours);
                *footprint = process.memory.sample(*elapsed, noise(process), room);
            }
        }

        alive
            .iter()
            .zip(footprints)
            .filter_map(|((process, _), footprint)| {
                footprint.map(|footprint| process_state(process, footprint, self.t))
            })
            .collect()
    }
}

fn total_memory(processes: &[ProcessState]) -> u64 {
    processes
        .iter()
        .map(|p| p.memory_used)
        .fold(0, u64::saturating_add)
}

/// What CUDA keeps per process outside the allocator.
const CUDA_CONTEXT_BYTES: u64 = 512 << 20;

/// The client's count, as shares of the live tensors at the peak (which the
/// simulated allocator keeps equal to what is allocated now).
fn composition(c: CompositionModel, peak: u64) -> Composition {
    let part = |share: f64, dtype| {
        Some(Part {
            bytes: (peak as f64 * share) as u64,
            dtype,
        })
    };
    Composition {
        weights: part(c.weights, c.dtype),
        gradients: part(c.gradients, c.dtype),
        optimizer_state: part(c.optimizer_state, c.optimizer_dtype),
    }
}

fn process_state(process: &Process, footprint: Footprint, t: f64) -> ProcessState {
    let started_s = process.start_s + footprint.incarnation_offset_s;
    let allocator = process.allocator.map(|a| {
        let reserved = footprint.bytes.saturating_sub(CUDA_CONTEXT_BYTES);
        let allocated = (reserved as f64 * (1.0 - a.fragmentation)) as u64;
        let cache = reserved - allocated.min(reserved);
        let age_min = ((t - started_s) / 60.0).max(0.0);
        AllocatorSnapshot {
            allocated,
            reserved,
            active: allocated + cache / 4,
            inactive_split: cache / 2,
            peak_allocated: allocated,
            alloc_retries: (a.retries_per_min * age_min) as u64,
            ooms: u64::from(a.oom_at_s.is_some_and(|at| t >= at && started_s <= at)),
            composition: a.composition.map(|c| composition(c, allocated)),
        }
    });
    ProcessState {
        pid: process.pid,
        start_time_ms: (started_s * 1000.0).round() as u64,
        name: process.name.clone(),
        user: process.user.clone(),
        uid: process.uid,
        container_id: process.container_id.clone(),
        pod_uid: process.pod_uid.clone(),
        pod_namespace: process.pod_namespace.clone(),
        slurm_job_id: process.slurm_job_id.clone(),
        slurm_account: process.slurm_account.clone(),
        process_group: process.process_group.unwrap_or(process.pid),
        pod_labels: process.pod_labels.clone(),
        memory_used: footprint.bytes,
        allocator,
    }
}
