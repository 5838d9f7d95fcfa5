//! A GPU's layout: its identity and, in MIG mode, its instances. NVML has
//! no change notification for MIG layouts that works everywhere, so the
//! thread reading the GPU re-reads the layout periodically and whenever an instance
//! handle stops working.

use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper::{Device, Nvml};

use crate::source::{GpuDevice, MigDevice};

use super::watchdog::Watch;

/// A MIG instance with its live handle.
#[derive(Debug)]
pub(crate) struct MigHandle<'nvml> {
    pub device: Device<'nvml>,
    pub uuid: std::sync::Arc<str>,
    pub memory_total: u64,
    /// The last graphics process list (read on slow polls only).
    pub graphics: Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>,
}

/// Reads GPU `device`'s layout. MIG instance slots that are empty (NVML
/// answers `NotFound` or `InvalidArg` for them) are skipped.
pub(crate) fn read_layout<'nvml>(
    nvml: &'nvml Nvml,
    device: &Device<'nvml>,
    index: u32,
    watchdog: &Watch<'_>,
) -> Result<(GpuDevice, Vec<MigHandle<'nvml>>), (&'static str, NvmlError)> {
    let uuid = watchdog
        .run("nvmlDeviceGetUUID", || device.uuid())
        .map_err(|e| ("nvmlDeviceGetUUID", e))?;
    let name = watchdog
        .run("nvmlDeviceGetName", || device.name())
        .map_err(|e| ("nvmlDeviceGetName", e))?;
    let memory_total = watchdog
        .run("nvmlDeviceGetMemoryInfo_v2", || device.memory_info())
        .map_err(|e| ("nvmlDeviceGetMemoryInfo_v2", e))?
        .total;
    let pci_bus_id = optional(watchdog.run("nvmlDeviceGetPciInfo_v3", || device.pci_info()))?
        .map(|pci| pci.bus_id)
        .unwrap_or_default();
    let pcie_generation = optional(watchdog.run("nvmlDeviceGetMaxPcieLinkGeneration", || {
        device.max_pcie_link_gen()
    }))?
    .unwrap_or(0);
    let pcie_width = optional(watchdog.run("nvmlDeviceGetMaxPcieLinkWidth", || {
        device.max_pcie_link_width()
    }))?
    .unwrap_or(0);
    let mig_enabled = optional(watchdog.run("nvmlDeviceGetMigMode", || device.mig_mode()))?
        .is_some_and(|mode| mode.current == 1);
    let mut handles = Vec::new();
    let mut instances = Vec::new();
    if mig_enabled {
        let slots = watchdog
            .run("nvmlDeviceGetMaxMigDeviceCount", || {
                device.mig_device_count()
            })
            .map_err(|e| ("nvmlDeviceGetMaxMigDeviceCount", e))?;
        for slot in 0..slots {
            let mig = match watchdog.run("nvmlDeviceGetMigDeviceHandleByIndex", || {
                device.mig_device_by_index(slot)
            }) {
                Ok(mig) => mig,
                Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                Err(e) => return Err(("nvmlDeviceGetMigDeviceHandleByIndex", e)),
            };
            let mig_uuid = watchdog
                .run("nvmlDeviceGetUUID", || mig.uuid())
                .map_err(|e| ("nvmlDeviceGetUUID", e))?;
            let mig_name = watchdog
                .run("nvmlDeviceGetName", || mig.name())
                .map_err(|e| ("nvmlDeviceGetName", e))?;
            let mig_total = watchdog
                .run("nvmlDeviceGetMemoryInfo_v2", || mig.memory_info())
                .map_err(|e| ("nvmlDeviceGetMemoryInfo_v2", e))?
                .total;
            let gpu_instance_id = watchdog
                .run("nvmlDeviceGetGpuInstanceId", || {
                    instance_id(nvml, &mig, InstanceId::Gpu)
                })
                .map_err(|e| ("nvmlDeviceGetGpuInstanceId", e))?;
            let compute_instance_id = watchdog
                .run("nvmlDeviceGetComputeInstanceId", || {
                    instance_id(nvml, &mig, InstanceId::Compute)
                })
                .map_err(|e| ("nvmlDeviceGetComputeInstanceId", e))?;
            instances.push(MigDevice {
                uuid: mig_uuid.clone(),
                gpu_instance_id,
                compute_instance_id,
                profile: profile_of(&mig_name),
                memory_total: mig_total,
            });
            handles.push(MigHandle {
                device: mig,
                uuid: mig_uuid.into(),
                memory_total: mig_total,
                graphics: Vec::new(),
            });
        }
    }
    Ok((
        GpuDevice {
            index,
            uuid,
            name,
            memory_total,
            pci_bus_id,
            pcie_generation,
            pcie_width,
            mig_instances: instances,
        },
        handles,
    ))
}

/// `NotSupported` means "this GPU has no such thing", not a failure.
fn optional<T>(result: Result<T, NvmlError>) -> Result<Option<T>, (&'static str, NvmlError)> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(NvmlError::NotSupported | NvmlError::FunctionNotFound) => Ok(None),
        Err(NvmlError::GpuLost) => Err(("layout", NvmlError::GpuLost)),
        Err(_) => Ok(None),
    }
}

/// NVML names a MIG device `<GPU name> MIG <profile>`; the profile
/// (`3g.40gb`) is what operators recognise.
pub(crate) fn profile_of(mig_name: &str) -> String {
    match mig_name.rsplit_once("MIG ") {
        Some((_, profile)) if !profile.trim().is_empty() => profile.trim().to_owned(),
        _ => mig_name.to_owned(),
    }
}

#[derive(Debug, Clone, Copy)]
enum InstanceId {
    Gpu,
    Compute,
}

/// nvml-wrapper has no wrappers for the instance-id calls, so they go
/// straight to the loaded library.
#[allow(unsafe_code)]
fn instance_id(nvml: &Nvml, mig: &Device<'_>, which: InstanceId) -> Result<u32, NvmlError> {
    let lib = nvml.lib();
    let call = match which {
        InstanceId::Gpu => lib.nvmlDeviceGetGpuInstanceId.as_ref(),
        InstanceId::Compute => lib.nvmlDeviceGetComputeInstanceId.as_ref(),
    }
    .map_err(|_| NvmlError::FunctionNotFound)?;
    let mut id: std::os::raw::c_uint = 0;
    // SAFETY: the handle comes from this library instance and is alive while
    // `mig` is; the call writes one c_uint through a pointer to a local.
    let code = unsafe { call(mig.handle(), &mut id) };
    nvml_try(code)?;
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::profile_of;

    #[test]
    fn profile_is_the_part_after_mig() {
        assert_eq!(profile_of("NVIDIA A100-SXM4-80GB MIG 3g.40gb"), "3g.40gb");
        assert_eq!(
            profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me"),
            "1g.10gb+me"
        );
        assert_eq!(profile_of("odd name"), "odd name");
    }
}
