//! Queries the scenario has no answer for, exported so that tools which
//! ask for them anyway (gpustat, nvidia-smi-like dashboards) get
//! `NVML_ERROR_NOT_SUPPORTED`, which they handle, rather than a missing
//! symbol, which pynvml turns into `FunctionNotFound` and nvml-wrapper into a
//! panic. Each still runs the device prologue: a bad handle is
//! `NVML_ERROR_INVALID_ARGUMENT`, a lost GPU `NVML_ERROR_GPU_IS_LOST`, and
//! `[[hang]]` faults apply.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong};

use nvml_wrapper_sys::bindings::{
    nvmlBAR1Memory_t, nvmlBrandType_t, nvmlClockType_t, nvmlComputeMode_t, nvmlDevice_t,
    nvmlDeviceArchitecture_t, nvmlEccCounterType_t, nvmlEnableState_t, nvmlMemoryErrorType_t,
    nvmlPstates_t, nvmlTemperatureThresholds_t,
};

use crate::call;
use crate::ffi::{NOT_SUPPORTED, nvmlReturn_t};

macro_rules! not_supported {
    ($(fn $name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, $($arg: $ty),*) -> nvmlReturn_t {
            $(let _ = $arg;)*
            call::device(stringify!($name), device, |_| Err(NOT_SUPPORTED))
        }
    )*};
}

not_supported! {
    fn nvmlDeviceGetTemperatureThreshold(
        threshold_type: nvmlTemperatureThresholds_t,
        temp: *mut c_uint
    );
    fn nvmlDeviceGetFanSpeed(speed: *mut c_uint);
    fn nvmlDeviceGetFanSpeed_v2(fan: c_uint, speed: *mut c_uint);
    fn nvmlDeviceGetNumFans(num_fans: *mut c_uint);
    fn nvmlDeviceGetPowerState(p_state: *mut nvmlPstates_t);
    fn nvmlDeviceGetPowerManagementLimit(limit: *mut c_uint);
    fn nvmlDeviceGetEnforcedPowerLimit(limit: *mut c_uint);
    fn nvmlDeviceGetTotalEnergyConsumption(energy: *mut c_ulonglong);
    fn nvmlDeviceGetEncoderUtilization(utilization: *mut c_uint, sampling_period_us: *mut c_uint);
    fn nvmlDeviceGetDecoderUtilization(utilization: *mut c_uint, sampling_period_us: *mut c_uint);
    fn nvmlDeviceGetMaxClockInfo(clock_type: nvmlClockType_t, clock: *mut c_uint);
    fn nvmlDeviceGetPerformanceState(p_state: *mut nvmlPstates_t);
    fn nvmlDeviceGetPersistenceMode(mode: *mut nvmlEnableState_t);
    fn nvmlDeviceGetComputeMode(mode: *mut nvmlComputeMode_t);
    fn nvmlDeviceGetDisplayMode(display: *mut nvmlEnableState_t);
    fn nvmlDeviceGetDisplayActive(is_active: *mut nvmlEnableState_t);
    fn nvmlDeviceGetSerial(serial: *mut c_char, length: c_uint);
    fn nvmlDeviceGetVbiosVersion(version: *mut c_char, length: c_uint);
    fn nvmlDeviceGetBoardPartNumber(part_number: *mut c_char, length: c_uint);
    fn nvmlDeviceGetBrand(brand: *mut nvmlBrandType_t);
    fn nvmlDeviceGetArchitecture(arch: *mut nvmlDeviceArchitecture_t);
    fn nvmlDeviceGetCudaComputeCapability(major: *mut c_int, minor: *mut c_int);
    fn nvmlDeviceGetPcieLinkMaxSpeed(max_speed: *mut c_uint);
    fn nvmlDeviceGetBAR1MemoryInfo(bar1_memory: *mut nvmlBAR1Memory_t);
    fn nvmlDeviceGetEccMode(current: *mut nvmlEnableState_t, pending: *mut nvmlEnableState_t);
    fn nvmlDeviceGetTotalEccErrors(
        error_type: nvmlMemoryErrorType_t,
        counter_type: nvmlEccCounterType_t,
        ecc_counts: *mut c_ulonglong
    );
    fn nvmlDeviceGetCurrentClocksThrottleReasons(reasons: *mut c_ulonglong);
    fn nvmlDeviceGetCurrentClocksEventReasons(reasons: *mut c_ulonglong);
}
