//! Per-device identity and readings: index, UUID, name, PCI, memory,
//! utilization, PCIe link.

use std::ffi::{c_char, c_uint};
use std::mem::size_of;

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlUtilization_t,
};

use crate::call::{self, Call};
use crate::ffi::{
    ARGUMENT_VERSION_MISMATCH, NOT_SUPPORTED, NvmlResult, Out, copy_str, nvmlReturn_t,
};
use crate::handles::Device;

/// `NVML_STRUCT_VERSION(Memory, 2)` from nvml.h.
const MEMORY_V2_VERSION: c_uint = size_of::<nvmlMemory_v2_t>() as c_uint | 2 << 24;
const NVIDIA_PCI_VENDOR_ID: c_uint = 0x10de;

/// Whole-GPU queries answer `NVML_ERROR_NOT_SUPPORTED` on a MIG handle.
pub(crate) fn whole_gpu(call: &Call) -> NvmlResult {
    match call.device {
        Device::Gpu(_) => Ok(()),
        Device::Mig { .. } => Err(NOT_SUPPORTED),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetIndex", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let index = unsafe { Out::new(index) }?;
        whole_gpu(call)?;
        index.set(call.info()?.index);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor_number: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetMinorNumber", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let minor_number = unsafe { Out::new(minor_number) }?;
        whole_gpu(call)?;
        minor_number.set(call.info()?.index);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetUUID", device, |call| {
        let text = match call.mig()? {
            Some(mig) => mig.instance.uuid.as_str(),
            None => call.info()?.uuid.as_str(),
        };
        // SAFETY: `uuid` is the caller's `length`-byte buffer.
        unsafe { copy_str(uuid, length, text) }
    })
}

/// A MIG device is named `<GPU name> MIG <profile>`, as NVIDIA's library
/// names it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetName", device, |call| {
        let gpu_name = &call.info()?.name;
        let text = match call.mig()? {
            Some(mig) => format!("{gpu_name} MIG {}", mig.instance.profile),
            None => gpu_name.clone(),
        };
        // SAFETY: `name` is the caller's `length`-byte buffer.
        unsafe { copy_str(name, length, &text) }
    })
}

/// The scenario's PCI address (domain 0, bus `index + 1`, device 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetPciInfo_v3", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let pci = unsafe { Out::new(pci) }?;
        whole_gpu(call)?;
        let full = &call.info()?.pci_bus_id;
        // `00000000:01:00.0`: the legacy form has a 4-digit domain.
        let legacy = full.get(4..).unwrap_or_default();
        let bus = full
            .split(':')
            .nth(1)
            .and_then(|bus| c_uint::from_str_radix(bus, 16).ok())
            .unwrap_or(0);
        let mut info = nvmlPciInfo_t {
            busIdLegacy: [0; 16],
            domain: 0,
            bus,
            device: 0,
            pciDeviceId: NVIDIA_PCI_VENDOR_ID,
            pciSubSystemId: 0,
            busId: [0; 32],
        };
        for (slot, byte) in info.busIdLegacy.iter_mut().zip(legacy.bytes()) {
            *slot = byte as c_char;
        }
        for (slot, byte) in info.busId.iter_mut().zip(full.bytes()) {
            *slot = byte as c_char;
        }
        pci.set(info);
        Ok(())
    })
}

/// `used` excludes `reserved`; `free = total - reserved - used`. On a MIG
/// handle: the instance's total and use, nothing reserved.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetMemoryInfo_v2", device, |call| {
        // SAFETY: an nvml.h in/out-parameter.
        let memory = unsafe { Out::new(memory) }?;
        // SAFETY: non-null, and nvml.h requires the caller to set `version`
        // before the call; only that field is read.
        let version = unsafe { (&raw const (*memory.as_ptr()).version).read() };
        if version != MEMORY_V2_VERSION {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let (total, reserved, used) = memory_of(call)?;
        memory.set(nvmlMemory_v2_t {
            version,
            total,
            reserved,
            free: total.saturating_sub(reserved).saturating_sub(used),
            used,
        });
        Ok(())
    })
}

/// The v1 struct has no `reserved`: like NVIDIA's library, `used` includes it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetMemoryInfo", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let memory = unsafe { Out::new(memory) }?;
        let (total, reserved, used) = memory_of(call)?;
        let used = used.saturating_add(reserved).min(total);
        memory.set(nvmlMemory_t {
            total,
            free: total - used,
            used,
        });
        Ok(())
    })
}

/// `(total, reserved, used)` of the GPU or MIG instance.
fn memory_of(call: &Call) -> NvmlResult<(u64, u64, u64)> {
    if let Some(mig) = call.mig()? {
        let used = mig.state.map_or(0, |state| state.memory_used);
        return Ok((mig.instance.memory_total, 0, used));
    }
    let state = &call.gpu()?.state;
    Ok((state.memory_total, state.memory_reserved, state.memory_used))
}

/// `gpu` is the scenario's utilization; memory-controller utilization is not
/// modelled and reads 0. Not supported on MIG handles, as on real GPUs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetUtilizationRates", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let utilization = unsafe { Out::new(utilization) }?;
        whole_gpu(call)?;
        utilization.set(nvmlUtilization_t {
            gpu: call.gpu()?.state.utilization_pct,
            memory: 0,
        });
        Ok(())
    })
}

/// The PCIe link getters: the sim's generation and width, for both the
/// maximum and the current link (no downtraining is modelled).
macro_rules! pcie_link {
    ($(fn $name:ident => $field:ident;)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, value: *mut c_uint) -> nvmlReturn_t {
            call::device(stringify!($name), device, |call| {
                // SAFETY: an nvml.h out-parameter.
                let value = unsafe { Out::new(value) }?;
                whole_gpu(call)?;
                value.set(call.info()?.$field);
                Ok(())
            })
        }
    )*};
}

pcie_link! {
    fn nvmlDeviceGetMaxPcieLinkGeneration => pcie_generation;
    fn nvmlDeviceGetCurrPcieLinkGeneration => pcie_generation;
    fn nvmlDeviceGetMaxPcieLinkWidth => pcie_width;
    fn nvmlDeviceGetCurrPcieLinkWidth => pcie_width;
}
