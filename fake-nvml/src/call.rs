//! The prologue of every exported function that takes a device: the panic
//! guard, the init check, the handle check, and the `gpu_lost` and `hang`
//! faults. Bodies receive a [`Call`] with the resolved target and the
//! current snapshot.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use headroom_sim::{GpuInfo, MigState};
use nvml_wrapper_sys::bindings::nvmlDevice_t;

use crate::config::Hang;
use crate::ffi::{GPU_IS_LOST, INVALID_ARGUMENT, NvmlResult, UNINITIALIZED, guard, nvmlReturn_t};
use crate::handles::Device;
use crate::host::{self, Host};
use crate::layout::MigInstance;
use crate::snapshot::{GpuNow, Snapshot};

/// Every exported function whose calls a `[[hang]]` fault can stall: those
/// that take a device handle, plus the index lookups. A test checks this
/// list against the sources.
pub(crate) const DEVICE_FUNCTIONS: &[&str] = &[
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetFanSpeed",
    "nvmlDeviceGetFanSpeed_v2",
    "nvmlDeviceGetNumFans",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetPowerState",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetPerformanceState",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceGetDisplayMode",
    "nvmlDeviceGetDisplayActive",
    "nvmlDeviceGetSerial",
    "nvmlDeviceGetVbiosVersion",
    "nvmlDeviceGetBoardPartNumber",
    "nvmlDeviceGetBrand",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetPcieLinkMaxSpeed",
    "nvmlDeviceGetBAR1MemoryInfo",
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetCurrentClocksEventReasons",
];

/// Hung calls sleep in slices this long, checking for a full shutdown.
const HANG_SLICE: Duration = Duration::from_millis(20);

/// One call's view: the host, the snapshot it answers from, and the device
/// its handle names.
#[derive(Debug)]
pub(crate) struct Call {
    pub host: &'static Host,
    pub now: Arc<Snapshot>,
    pub device: Device,
}

/// A MIG instance as a call sees it: its static description and its state.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MigNow<'a> {
    pub instance: &'a MigInstance,
    pub state: Option<&'a MigState>,
}

impl Call {
    pub(crate) fn gpu_index(&self) -> usize {
        self.device.gpu()
    }

    pub(crate) fn info(&self) -> NvmlResult<&GpuInfo> {
        self.host
            .inventory
            .get(self.gpu_index())
            .ok_or(INVALID_ARGUMENT)
    }

    pub(crate) fn gpu(&self) -> NvmlResult<&GpuNow> {
        self.now.gpus.get(self.gpu_index()).ok_or(INVALID_ARGUMENT)
    }

    /// The GPU's current MIG instances (none outside MIG mode).
    pub(crate) fn instances(&self) -> NvmlResult<&[MigInstance]> {
        let generation = self.gpu()?.generation;
        let layouts = self
            .host
            .layouts
            .get(self.gpu_index())
            .ok_or(INVALID_ARGUMENT)?;
        Ok(layouts.instances(generation))
    }

    pub(crate) fn mig_at(&self, index: usize) -> NvmlResult<Option<MigNow<'_>>> {
        let Some(instance) = self.instances()?.get(index) else {
            return Ok(None);
        };
        let state = self.gpu()?.state.mig.get(index);
        Ok(Some(MigNow { instance, state }))
    }

    /// The MIG instance a MIG handle names; `None` for a whole-GPU handle.
    pub(crate) fn mig(&self) -> NvmlResult<Option<MigNow<'_>>> {
        match self.device {
            Device::Gpu(_) => Ok(None),
            Device::Mig { instance, .. } => self.mig_at(instance),
        }
    }
}

/// Runs `body` for a device function named `function`.
pub(crate) fn device(
    function: &'static str,
    handle: nvmlDevice_t,
    body: impl FnOnce(&Call) -> NvmlResult,
) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        let device = Device::decode(handle).ok_or(INVALID_ARGUMENT)?;
        let call = enter(host, function, device)?;
        body(&call)
    })
}

/// The prologue for a call naming a GPU by index (the handle lookups).
pub(crate) fn index(
    function: &'static str,
    index: usize,
    body: impl FnOnce(&Call) -> NvmlResult,
) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        let call = enter(host, function, Device::Gpu(index))?;
        body(&call)
    })
}

fn enter(host: &'static Host, function: &'static str, device: Device) -> NvmlResult<Call> {
    let call = resolve(host, device)?;
    let Some(hang) = host.faults.hang(device.gpu(), function, call.now.t) else {
        return Ok(call);
    };
    drop(call);
    stall(hang)?;
    // The world moved on while the call hung: answer from the state now.
    resolve(host, device)
}

/// Checks that `device` names a GPU (and MIG instance) that exists now and
/// is not lost.
fn resolve(host: &'static Host, device: Device) -> NvmlResult<Call> {
    let now = host.snapshot();
    let gpu = now.gpus.get(device.gpu()).ok_or(INVALID_ARGUMENT)?;
    if host.faults.is_lost(device.gpu(), now.t) {
        return Err(GPU_IS_LOST);
    }
    if let Device::Mig {
        generation,
        instance,
        ..
    } = device
    {
        let current = host
            .layouts
            .get(device.gpu())
            .map_or(0, |layouts| layouts.instances(gpu.generation).len());
        if generation != gpu.generation || instance >= current {
            return Err(INVALID_ARGUMENT);
        }
    }
    Ok(Call { host, now, device })
}

/// Sleeps for the hang's duration (forever if it has none), in short
/// slices; gives up with `NVML_ERROR_UNINITIALIZED` if the library is shut
/// down meanwhile.
fn stall(hang: &Hang) -> NvmlResult {
    let until = hang
        .duration_s
        .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
        .and_then(|duration| Instant::now().checked_add(duration));
    loop {
        if !host::is_initialized() {
            return Err(UNINITIALIZED);
        }
        let slice = match until {
            None => HANG_SLICE,
            Some(until) => match until.checked_duration_since(Instant::now()) {
                None => return Ok(()),
                Some(left) => left.min(HANG_SLICE),
            },
        };
        thread::sleep(slice);
    }
}

#[cfg(test)]
mod tests {
    use super::DEVICE_FUNCTIONS;

    /// Every name passed to the call prologue is listed, and every listed
    /// name is an export defined in the sources: a `[[hang]]` on a listed
    /// function can fire, and no function escapes validation.
    #[test]
    fn device_functions_match_the_sources() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut sources = String::new();
        let mut used = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.file_name().is_some_and(|name| name == "call.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for marker in ["call::device(", "call::index("] {
                for (at, _) in text.match_indices(marker) {
                    let rest = text[at + marker.len()..].trim_start();
                    if let Some(rest) = rest.strip_prefix('"') {
                        used.push(rest[..rest.find('"').unwrap()].to_owned());
                    }
                }
            }
            sources.push_str(&text);
        }
        for name in DEVICE_FUNCTIONS {
            let defined = [format!("fn {name}("), format!("fn {name} ")]
                .iter()
                .any(|definition| sources.contains(definition.as_str()));
            assert!(defined, "{name} is listed but not exported");
        }
        for name in &used {
            assert!(
                DEVICE_FUNCTIONS.contains(&name.as_str()),
                "{name} is missing from DEVICE_FUNCTIONS"
            );
        }
        assert!(used.len() > 10, "found only {used:?}");
    }
}
