//! Reading one GPU and its MIG instances: every NVML call a poll makes for
//! them, under the watch of the thread that reads it ([`super::poller`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};

use crate::source::{DeviceReading, GpuDevice, GpuHealth};

use super::mig::{MigHandle, read_layout};
use super::pcie::{CounterRate, ThroughputBoard};
use super::watchdog::Watch;

/// NVML field ids of the cumulative PCIe byte counters (`nvml.h`).
const PCIE_TX_BYTES: FieldId = FieldId(197);
const PCIE_RX_BYTES: FieldId = FieldId(198);

#[derive(Debug)]
pub(crate) struct GpuReply {
    pub index: u32,
    pub outcome: Outcome,
}

#[derive(Debug)]
pub(crate) enum Outcome {
    Reading(GpuReading),
    /// The GPU fell off the bus (`NVML_ERROR_GPU_IS_LOST`); its thread stops
    /// reading it (and ends if it read no other).
    Lost,
    Failed {
        call: &'static str,
        reason: String,
    },
}

#[derive(Debug, Default)]
pub(crate) struct GpuReading {
    /// The GPU's layout when it is new or changed since the last reading.
    pub layout: Option<GpuDevice>,
    pub devices: Vec<DeviceReading>,
    pub processes: Vec<RawProcess>,
    /// Readings NVML gave that cannot be true, described for an event.
    pub invalid: Vec<Invalid>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RawProcess {
    /// Shared with the device's layout: one reference count per process per
    /// poll instead of a copy of the UUID.
    pub device_uuid: Arc<str>,
    pub pid: u32,
    /// `None` where NVML cannot tell (MIG without privileges, WDDM).
    pub memory_used: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Invalid {
    pub device_uuid: String,
    pub pid: u32,
    pub detail: String,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadTiming {
    /// How often the layout (MIG instances) is re-read.
    pub layout_check: Duration,
    /// Utilisation and graphics processes are read on one poll in this
    /// many (see `NvmlOptions::slow_every`).
    pub slow_every: u64,
    /// Temperature, power and SM clock are read on the slow polls too.
    pub read_health: bool,
}

pub(crate) struct Gpu<'a> {
    nvml: &'a Nvml,
    index: u32,
    watch: Watch<'a>,
    pcie: &'a ThroughputBoard,
    timing: ReadTiming,
    state: Option<GpuState<'a>>,
}

struct GpuState<'a> {
    device: Device<'a>,
    layout: GpuDevice,
    /// `layout.uuid`, shared with every process reading of this GPU.
    uuid: Arc<str>,
    mig: Vec<MigHandle<'a>>,
    layout_read: Instant,
    /// A MIG handle stopped working: re-read the layout on the next poll.
    layout_due: bool,
    counters_supported: bool,
    tx: CounterRate,
    rx: CounterRate,
    /// Polls so far; every `slow_every`-th reads the slow-moving values.
    polls: u64,
    utilization: Option<u32>,
    health: Option<GpuHealth>,
    graphics: Vec<ProcessInfo>,
}

/// An NVML failure: lost GPUs end the thread, anything else fails one read.
type CallError = (&'static str, NvmlError);

impl<'a> Gpu<'a> {
    /// A GPU whose layout is read on its first poll.
    pub(crate) fn new(
        nvml: &'a Nvml,
        index: u32,
        watch: Watch<'a>,
        pcie: &'a ThroughputBoard,
        timing: ReadTiming,
    ) -> Self {
        Self {
            nvml,
            index,
            watch,
            pcie,
            timing,
            state: None,
        }
    }

    pub(crate) fn index(&self) -> u32 {
        self.index
    }

    pub(crate) fn read(&mut self) -> Outcome {
        match self.try_read() {
            Ok(reading) => Outcome::Reading(reading),
            Err((_, NvmlError::GpuLost)) => Outcome::Lost,
            Err((call, error)) => {
                // Re-read the layout next time: a stale MIG handle or a GPU
                // that came back answers differently.
                self.state = None;
                Outcome::Failed {
                    call,
                    reason: error.to_string(),
                }
            }
        }
    }

    fn try_read(&mut self) -> Result<GpuReading, CallError> {
        let mut reading = GpuReading::default();
        let stale = self
            .state
            .as_ref()
            .is_none_or(|s| s.layout_due || s.layout_read.elapsed() >= self.timing.layout_check);
        if stale {
            self.refresh_layout(&mut reading)?;
        }
        let Some(state) = self.state.as_mut() else {
            return Ok(reading);
        };
        let watchdog = &self.watch;
        let slow = state.polls % self.timing.slow_every.max(1) == 0;
        state.polls += 1;
        let memory = watchdog
            .run("nvmlDeviceGetMemoryInfo_v2", || state.device.memory_info())
            .map_err(|e| ("nvmlDeviceGetMemoryInfo_v2", e))?;
        if slow {
            // NVML averages utilisation over its own sample period (up to a
            // second), so reading it at every 10 Hz poll adds calls, not
            // information.
            state.utilization = match watchdog.run("nvmlDeviceGetUtilizationRates", || {
                state.device.utilization_rates()
            }) {
                Ok(u) => Some(u.gpu.min(100)),
                Err(NvmlError::GpuLost) => {
                    return Err(("nvmlDeviceGetUtilizationRates", NvmlError::GpuLost));
                }
                Err(_) => None,
            };
        }
        if slow && self.timing.read_health {
            state.health = Some(read_health(&state.device, watchdog)?);
        }
        let utilization = state.utilization;
        let (tx, rx) = read_pcie(state, watchdog, self.pcie, self.index)?;
        let uuid = state.uuid.clone();
        push_memory(
            &mut reading,
            DeviceReading {
                uuid: uuid.to_string(),
                memory_used: memory.used,
                memory_reserved: memory.reserved,
                memory_total: memory.total,
                utilization_pct: utilization,
                pcie_tx_bytes_per_s: tx,
                pcie_rx_bytes_per_s: rx,
                health: state.health,
            },
        );
        if state.mig.is_empty() {
            let processes = running_processes(&state.device, watchdog, &mut state.graphics, slow)?;
            push_processes(&mut reading, &uuid, memory.total, processes);
        } else {
            let mut stale_handle = false;
            for mig in &mut state.mig {
                let memory =
                    match watchdog.run("nvmlDeviceGetMemoryInfo_v2", || mig.device.memory_info()) {
                        Ok(memory) => memory,
                        Err(NvmlError::GpuLost) => {
                            return Err(("nvmlDeviceGetMemoryInfo_v2", NvmlError::GpuLost));
                        }
                        Err(_) => {
                            stale_handle = true;
                            continue;
                        }
                    };
                push_memory(
                    &mut reading,
                    DeviceReading {
                        uuid: mig.uuid.to_string(),
                        memory_used: memory.used,
                        memory_reserved: memory.reserved,
                        memory_total: mig.memory_total,
                        utilization_pct: None,
                        pcie_tx_bytes_per_s: None,
                        pcie_rx_bytes_per_s: None,
                        health: None,
                    },
                );
                match running_processes(&mig.device, watchdog, &mut mig.graphics, slow) {
                    Ok(processes) => {
                        push_processes(&mut reading, &mig.uuid, mig.memory_total, processes);
                    }
                    Err((call, NvmlError::GpuLost)) => return Err((call, NvmlError::GpuLost)),
                    Err(_) => stale_handle = true,
                }
            }
            if stale_handle {
                // The layout changed under us; read it again on the next poll.
                state.layout_due = true;
            }
        }
        Ok(reading)
    }

    fn refresh_layout(&mut self, reading: &mut GpuReading) -> Result<(), CallError> {
        let nvml = self.nvml;
        if let Some(state) = &mut self.state {
            let (layout, mig) = read_layout(nvml, &state.device, self.index, &self.watch)?;
            if state.layout != layout {
                reading.layout = Some(layout.clone());
                state.uuid = layout.uuid.as_str().into();
                state.layout = layout;
            }
            state.mig = mig;
            state.layout_read = Instant::now();
            state.layout_due = false;
            return Ok(());
        }
        let device = self
            .watch
            .run("nvmlDeviceGetHandleByIndex_v2", || {
                nvml.device_by_index(self.index)
            })
            .map_err(|e| ("nvmlDeviceGetHandleByIndex_v2", e))?;
        let (layout, mig) = read_layout(nvml, &device, self.index, &self.watch)?;
        reading.layout = Some(layout.clone());
        self.state = Some(GpuState {
            device,
            uuid: layout.uuid.as_str().into(),
            layout,
            mig,
            layout_read: Instant::now(),
            layout_due: false,
            counters_supported: true,
            tx: CounterRate::default(),
            rx: CounterRate::default(),
            polls: 0,
            utilization: None,
            health: None,
            graphics: Vec::new(),
        });
        Ok(())
    }
}

/// A figure a GPU does not report is `None`; only a lost GPU fails the read.
fn read_health(device: &Device<'_>, watchdog: &Watch<'_>) -> Result<GpuHealth, CallError> {
    fn figure(
        call: &'static str,
        result: Result<u32, NvmlError>,
    ) -> Result<Option<u32>, CallError> {
        match result {
            Ok(value) => Ok(Some(value)),
            Err(NvmlError::GpuLost) => Err((call, NvmlError::GpuLost)),
            Err(_) => Ok(None),
        }
    }
    Ok(GpuHealth {
        temperature_c: figure(
            "nvmlDeviceGetTemperature",
            watchdog.run("nvmlDeviceGetTemperature", || {
                device.temperature(TemperatureSensor::Gpu)
            }),
        )?,
        power_mw: figure(
            "nvmlDeviceGetPowerUsage",
            watchdog.run("nvmlDeviceGetPowerUsage", || device.power_usage()),
        )?,
        sm_clock_mhz: figure(
            "nvmlDeviceGetClockInfo",
            watchdog.run("nvmlDeviceGetClockInfo", || device.clock_info(Clock::SM)),
        )?,
    })
}

/// A device reading that cannot be true is reported, not stored.
fn push_memory(reading: &mut GpuReading, device: DeviceReading) {
    if device.memory_used.saturating_add(device.memory_reserved) > device.memory_total {
        reading.invalid.push(Invalid {
            device_uuid: device.uuid.clone(),
            pid: 0,
            detail: format!(
                "NVML reported {} B used + {} B reserved on a device of {} B",
                device.memory_used, device.memory_reserved, device.memory_total
            ),
        });
        return;
    }
    reading.devices.push(device);
}

fn push_processes(
    reading: &mut GpuReading,
    device_uuid: &Arc<str>,
    device_total: u64,
    processes: Vec<ProcessInfo>,
) {
    for p in processes {
        let memory_used = match p.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => Some(bytes),
            UsedGpuMemory::Unavailable => None,
        };
        let problem = if p.pid == 0 {
            Some("NVML listed a process with pid 0".to_owned())
        } else {
            memory_used.filter(|m| *m > device_total).map(|m| {
                format!(
                    "NVML reported pid {} holding {m} B on a device of {device_total} B",
                    p.pid
                )
            })
        };
        if let Some(detail) = problem {
            reading.invalid.push(Invalid {
                device_uuid: device_uuid.to_string(),
                pid: p.pid,
                detail,
            });
            continue;
        }
        // A process with both a compute and a graphics context is listed
        // twice with the same memory.
        if reading
            .processes
            .iter()
            .any(|q| q.pid == p.pid && Arc::ptr_eq(&q.device_uuid, device_uuid))
        {
            continue;
        }
        reading.processes.push(RawProcess {
            device_uuid: device_uuid.clone(),
            pid: p.pid,
            memory_used,
        });
    }
}

/// Compute processes on every poll; graphics contexts (rare on compute
/// GPUs, and their memory is in `used` either way) on slow polls, reusing
/// the last list in between.
fn running_processes(
    device: &Device<'_>,
    watchdog: &Watch<'_>,
    graphics: &mut Vec<ProcessInfo>,
    slow: bool,
) -> Result<Vec<ProcessInfo>, CallError> {
    let mut processes = watchdog
        .run("nvmlDeviceGetComputeRunningProcesses_v3", || {
            device.running_compute_processes()
        })
        .map_err(|e| ("nvmlDeviceGetComputeRunningProcesses_v3", e))?;
    if slow {
        *graphics = match watchdog.run("nvmlDeviceGetGraphicsRunningProcesses_v3", || {
            device.running_graphics_processes()
        }) {
            Ok(list) => list,
            Err(NvmlError::GpuLost) => {
                return Err((
                    "nvmlDeviceGetGraphicsRunningProcesses_v3",
                    NvmlError::GpuLost,
                ));
            }
            // A GPU without graphics support says so here.
            Err(_) => Vec::new(),
        };
    }
    processes.extend(graphics.iter().cloned());
    Ok(processes)
}

fn read_pcie(
    state: &mut GpuState<'_>,
    watchdog: &Watch<'_>,
    board: &ThroughputBoard,
    index: u32,
) -> Result<super::pcie::Rates, CallError> {
    if !state.counters_supported {
        return Ok(board.latest(index));
    }
    let values = match watchdog.run("nvmlDeviceGetFieldValues", || {
        state
            .device
            .field_values_for(&[PCIE_TX_BYTES, PCIE_RX_BYTES])
    }) {
        Ok(values) => values,
        Err(NvmlError::GpuLost) => return Err(("nvmlDeviceGetFieldValues", NvmlError::GpuLost)),
        Err(_) => Vec::new(),
    };
    let counter = |i: usize| -> Option<(u64, i64)> {
        let sample = values.get(i)?.as_ref().ok()?;
        let value = match sample.value.as_ref().ok()? {
            nvml_wrapper::enums::device::SampleValue::U64(v) => *v,
            nvml_wrapper::enums::device::SampleValue::U32(v) => u64::from(*v),
            nvml_wrapper::enums::device::SampleValue::I64(v) => u64::try_from(*v).ok()?,
            nvml_wrapper::enums::device::SampleValue::F64(_) => return None,
        };
        Some((value, sample.timestamp))
    };
    match (counter(0), counter(1)) {
        (Some((tx, tx_at)), Some((rx, rx_at))) => {
            Ok((state.tx.update(tx, tx_at), state.rx.update(rx, rx_at)))
        }
        _ => {
            tracing::info!(
                gpu = index,
                "PCIe byte counters not supported; sampling nvmlDeviceGetPcieThroughput on its own thread instead"
            );
            state.counters_supported = false;
            board.want(index);
            Ok((None, None))
        }
    }
}
