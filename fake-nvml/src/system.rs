//! Library lifetime and system-wide queries: init/shutdown, error strings,
//! versions, the device count and the handle lookups.

use std::ffi::{c_char, c_int, c_uint};

use nvml_wrapper_sys::bindings::nvmlDevice_t;

use crate::call;
use crate::ffi::{
    GPU_IS_LOST, INVALID_ARGUMENT, NOT_FOUND, NvmlResult, Out, copy_str, error_string, guard,
    nvmlReturn_t, read_str,
};
use crate::handles::Device;
use crate::host;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    guard(host::init)
}

/// The pre-v2 name.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit() -> nvmlReturn_t {
    guard(host::init)
}

/// The flags (`NVML_INIT_FLAG_NO_GPUS`, `NO_ATTACH`) change nothing here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    guard(host::init)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guard(host::shutdown)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    std::panic::catch_unwind(|| error_string(result))
        .unwrap_or(c"Unknown Error")
        .as_ptr()
}

/// The scenario node's `driver_version`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        // SAFETY: the caller's `length`-byte buffer.
        unsafe { copy_str(version, length, &host.node.driver_version) }
    })
}

/// `12.<driver version>`, the shape of NVIDIA's NVML version strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        let text = format!("12.{}", host.node.driver_version);
        // SAFETY: the caller's `length`-byte buffer.
        unsafe { copy_str(version, length, &text) }
    })
}

/// The CUDA version a driver of the node's branch ships, as `1000 × major +
/// 10 × minor`.
fn cuda_version(driver_version: &str) -> c_int {
    let branch: u32 = driver_version
        .split('.')
        .next()
        .and_then(|major| major.parse().ok())
        .unwrap_or(0);
    match branch {
        570.. => 12080,
        560.. => 12060,
        550.. => 12040,
        545.. => 12030,
        535.. => 12020,
        530.. => 12010,
        525.. => 12000,
        _ => 11080,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(
    cuda_driver_version: *mut c_int,
) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        // SAFETY: an nvml.h out-parameter.
        let out = unsafe { Out::new(cuda_driver_version) }?;
        out.set(cuda_version(&host.node.driver_version));
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(
    cuda_driver_version: *mut c_int,
) -> nvmlReturn_t {
    // SAFETY: the same contract as nvmlSystemGetCudaDriverVersion's.
    unsafe { nvmlSystemGetCudaDriverVersion(cuda_driver_version) }
}

/// The scenario's name for a pid on this node (the simulated processes do
/// not exist on the machine running the library); `NVML_ERROR_NOT_FOUND`
/// for any other pid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetProcessName(
    pid: c_uint,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        let now = host.snapshot();
        let process = now
            .gpus
            .iter()
            .flat_map(|gpu| {
                let direct = gpu.state.processes.iter();
                direct.chain(gpu.state.mig.iter().flat_map(|mig| mig.processes.iter()))
            })
            .find(|process| process.pid == pid)
            .ok_or(NOT_FOUND)?;
        // SAFETY: the caller's `length`-byte buffer.
        unsafe { copy_str(name, length, &process.name) }
    })
}

/// Every GPU of the node, lost ones included.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(device_count: *mut c_uint) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        // SAFETY: an nvml.h out-parameter.
        let out = unsafe { Out::new(device_count) }?;
        out.set(c_uint::try_from(host.gpu_count()).unwrap_or(c_uint::MAX));
        Ok(())
    })
}

/// The pre-v2 name.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(device_count: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: the same contract as nvmlDeviceGetCount_v2's.
    unsafe { nvmlDeviceGetCount_v2(device_count) }
}

/// `NVML_ERROR_INVALID_ARGUMENT` past the last GPU, `NVML_ERROR_GPU_IS_LOST`
/// for a lost one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    call::index("nvmlDeviceGetHandleByIndex_v2", index as usize, |call| {
        // SAFETY: an nvml.h out-parameter.
        unsafe { write_handle(device, call.device) }
    })
}

/// The pre-v2 name (which skipped GPUs the caller had no permission for;
/// here every GPU is visible, so the two agree).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    call::index("nvmlDeviceGetHandleByIndex", index as usize, |call| {
        // SAFETY: an nvml.h out-parameter.
        unsafe { write_handle(device, call.device) }
    })
}

/// Accepts GPU and MIG UUIDs, as NVIDIA's library does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        // SAFETY: a NUL-terminated string per nvml.h.
        let uuid = unsafe { read_str(uuid) }?;
        let now = host.snapshot();
        let found = host.inventory.iter().enumerate().find_map(|(gpu, info)| {
            if info.uuid == uuid {
                return Some(Device::Gpu(gpu));
            }
            let generation = now.gpus.get(gpu)?.generation;
            let instances = host.layouts.get(gpu)?.instances(generation);
            let instance = instances.iter().position(|mig| mig.uuid == uuid)?;
            Some(Device::Mig {
                gpu,
                generation,
                instance,
            })
        });
        let found = found.ok_or(NOT_FOUND)?;
        if host.faults.is_lost(found.gpu(), now.t) {
            return Err(GPU_IS_LOST);
        }
        // SAFETY: an nvml.h out-parameter.
        unsafe { write_handle(device, found) }
    })
}

/// # Safety
///
/// `out` must be null or valid for a write of one handle.
unsafe fn write_handle(out: *mut nvmlDevice_t, device: Device) -> NvmlResult {
    // SAFETY: per this function's contract.
    let out = unsafe { Out::new(out) }?;
    out.set(device.encode().ok_or(INVALID_ARGUMENT)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::cuda_version;

    #[test]
    fn cuda_version_follows_the_driver_branch() {
        assert_eq!(cuda_version("550.54.15"), 12040);
        assert_eq!(cuda_version("535.161.08"), 12020);
        assert_eq!(cuda_version("470.1"), 11080);
        assert_eq!(cuda_version("garbage"), 11080);
    }
}
