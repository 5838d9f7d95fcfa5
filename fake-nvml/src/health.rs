//! The figures dashboards chart beside memory: temperature, power draw and
//! SM clock, from the scenario's model (they follow utilization). Whole-GPU
//! queries, as on real GPUs: a MIG handle is `NVML_ERROR_NOT_SUPPORTED`.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{
    nvmlClockType_enum_NVML_CLOCK_GRAPHICS, nvmlClockType_enum_NVML_CLOCK_SM, nvmlClockType_t,
    nvmlDevice_t, nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU, nvmlTemperatureSensors_t,
};

use crate::call;
use crate::device::whole_gpu;
use crate::ffi::{INVALID_ARGUMENT, NOT_SUPPORTED, Out, nvmlReturn_t};

/// The GPU die's sensor only; nvml.h has no other sensor.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor_type: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetTemperature", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let temp = unsafe { Out::new(temp) }?;
        whole_gpu(call)?;
        if sensor_type != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return Err(INVALID_ARGUMENT);
        }
        temp.set(call.gpu()?.state.temperature_c);
        Ok(())
    })
}

/// Milliwatts, as nvml.h specifies.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    power: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetPowerUsage", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let power = unsafe { Out::new(power) }?;
        whole_gpu(call)?;
        power.set(call.gpu()?.state.power_mw);
        Ok(())
    })
}

/// The SM and graphics clocks (one domain on data-centre GPUs), in MHz;
/// memory and video clocks are not modelled.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    clock_type: nvmlClockType_t,
    clock: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetClockInfo", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let clock = unsafe { Out::new(clock) }?;
        whole_gpu(call)?;
        #[allow(non_upper_case_globals)]
        match clock_type {
            nvmlClockType_enum_NVML_CLOCK_SM | nvmlClockType_enum_NVML_CLOCK_GRAPHICS => {
                clock.set(call.gpu()?.state.sm_clock_mhz);
                Ok(())
            }
            _ => Err(NOT_SUPPORTED),
        }
    })
}
