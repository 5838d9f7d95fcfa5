//! MIG: mode, instance enumeration, and the handle conversions.
//!
//! A GPU is in MIG mode while its current layout (see `layout`) has
//! instances. Whole-GPU queries on a MIG handle, and MIG-instance queries on
//! a GPU handle, answer `NVML_ERROR_NOT_SUPPORTED`.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE, nvmlDevice_t};

use crate::call::{self, Call, MigNow};
use crate::ffi::{INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED, NvmlResult, Out, nvmlReturn_t};
use crate::handles::Device;

/// `nvmlDeviceGetMaxMigDeviceCount` on a GPU in MIG mode: A100/H100 have 7
/// slots.
const MAX_MIG_DEVICES: usize = 7;

fn parent_only(call: &Call) -> NvmlResult {
    match call.device {
        Device::Gpu(_) => Ok(()),
        Device::Mig { .. } => Err(NOT_SUPPORTED),
    }
}

fn instance_only(call: &Call) -> NvmlResult<MigNow<'_>> {
    call.mig()?.ok_or(NOT_SUPPORTED)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current_mode: *mut c_uint,
    pending_mode: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetMigMode", device, |call| {
        // SAFETY: nvml.h out-parameters.
        let (current, pending) = unsafe { (Out::new(current_mode)?, Out::new(pending_mode)?) };
        parent_only(call)?;
        let mode = if call.instances()?.is_empty() {
            NVML_DEVICE_MIG_DISABLE
        } else {
            NVML_DEVICE_MIG_ENABLE
        };
        current.set(mode);
        pending.set(mode);
        Ok(())
    })
}

/// 7 in MIG mode (more if the scenario has more instances), else 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetMaxMigDeviceCount", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let count = unsafe { Out::new(count) }?;
        parent_only(call)?;
        let instances = call.instances()?.len();
        let max = if instances == 0 {
            0
        } else {
            instances.max(MAX_MIG_DEVICES)
        };
        count.set(c_uint::try_from(max).unwrap_or(c_uint::MAX));
        Ok(())
    })
}

/// `NVML_ERROR_NOT_FOUND` past the last instance.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetMigDeviceHandleByIndex", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let mig_device = unsafe { Out::new(mig_device) }?;
        parent_only(call)?;
        let instance = index as usize;
        if instance >= call.instances()?.len() {
            return Err(NOT_FOUND);
        }
        let handle = Device::Mig {
            gpu: call.gpu_index(),
            generation: call.gpu()?.generation,
            instance,
        };
        mig_device.set(handle.encode().ok_or(NOT_FOUND)?);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig_device: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceIsMigDeviceHandle", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let is_mig_device = unsafe { Out::new(is_mig_device) }?;
        is_mig_device.set(c_uint::from(matches!(call.device, Device::Mig { .. })));
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetGpuInstanceId", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let id = unsafe { Out::new(id) }?;
        id.set(instance_only(call)?.instance.gpu_instance_id);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetComputeInstanceId", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let id = unsafe { Out::new(id) }?;
        id.set(instance_only(call)?.instance.compute_instance_id);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    call::device(
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        mig_device,
        |call| {
            // SAFETY: an nvml.h out-parameter.
            let device = unsafe { Out::new(device) }?;
            instance_only(call)?;
            let parent = Device::Gpu(call.gpu_index()).encode();
            device.set(parent.ok_or(INVALID_ARGUMENT)?);
            Ok(())
        },
    )
}
