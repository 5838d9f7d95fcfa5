//! Compile-time proof that every export has exactly the C signature nvml.h
//! gives it: `NvmlLib` (bindgen's output of nvml.h) holds each function as
//! `Result<unsafe extern "C" fn(..) -> nvmlReturn_t, _>`, and `same` only
//! type-checks if our function coerces to that very pointer type. Nothing
//! here runs.
#![allow(dead_code)]

use nvml_wrapper_sys::bindings::NvmlLib;

use crate::{device, events, fields, gpustat_compat as compat, health, mig, processes, system};

fn same<F, E>(_: &Result<F, E>, _: F) {}

macro_rules! check {
    ($lib:ident: $($module:ident::$name:ident),* $(,)?) => {
        $(same(&$lib.$name, $module::$name);)*
    };
}

fn current(lib: &NvmlLib) {
    check!(lib:
        system::nvmlInit_v2,
        system::nvmlInitWithFlags,
        system::nvmlShutdown,
        system::nvmlErrorString,
        system::nvmlSystemGetDriverVersion,
        system::nvmlSystemGetNVMLVersion,
        system::nvmlSystemGetCudaDriverVersion,
        system::nvmlSystemGetCudaDriverVersion_v2,
        system::nvmlSystemGetProcessName,
        system::nvmlDeviceGetCount_v2,
        system::nvmlDeviceGetHandleByIndex_v2,
        system::nvmlDeviceGetHandleByUUID,
        device::nvmlDeviceGetIndex,
        device::nvmlDeviceGetMinorNumber,
        device::nvmlDeviceGetUUID,
        device::nvmlDeviceGetName,
        device::nvmlDeviceGetPciInfo_v3,
        device::nvmlDeviceGetMemoryInfo,
        device::nvmlDeviceGetMemoryInfo_v2,
        device::nvmlDeviceGetUtilizationRates,
        device::nvmlDeviceGetMaxPcieLinkGeneration,
        device::nvmlDeviceGetMaxPcieLinkWidth,
        device::nvmlDeviceGetCurrPcieLinkGeneration,
        device::nvmlDeviceGetCurrPcieLinkWidth,
        processes::nvmlDeviceGetComputeRunningProcesses_v3,
        processes::nvmlDeviceGetGraphicsRunningProcesses_v3,
        processes::nvmlDeviceGetMPSComputeRunningProcesses_v3,
        mig::nvmlDeviceGetMigMode,
        mig::nvmlDeviceGetMaxMigDeviceCount,
        mig::nvmlDeviceGetMigDeviceHandleByIndex,
        mig::nvmlDeviceIsMigDeviceHandle,
        mig::nvmlDeviceGetGpuInstanceId,
        mig::nvmlDeviceGetComputeInstanceId,
        mig::nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
        fields::nvmlDeviceGetFieldValues,
        fields::nvmlDeviceGetPcieThroughput,
        events::nvmlEventSetCreate,
        events::nvmlEventSetFree,
        events::nvmlEventSetWait_v2,
        events::nvmlDeviceGetSupportedEventTypes,
        events::nvmlDeviceRegisterEvents,
        health::nvmlDeviceGetTemperature,
        compat::nvmlDeviceGetTemperatureThreshold,
        compat::nvmlDeviceGetFanSpeed,
        compat::nvmlDeviceGetFanSpeed_v2,
        compat::nvmlDeviceGetNumFans,
        health::nvmlDeviceGetPowerUsage,
        compat::nvmlDeviceGetPowerState,
        compat::nvmlDeviceGetPowerManagementLimit,
        compat::nvmlDeviceGetEnforcedPowerLimit,
        compat::nvmlDeviceGetTotalEnergyConsumption,
        compat::nvmlDeviceGetEncoderUtilization,
        compat::nvmlDeviceGetDecoderUtilization,
        health::nvmlDeviceGetClockInfo,
        compat::nvmlDeviceGetMaxClockInfo,
        compat::nvmlDeviceGetPerformanceState,
        compat::nvmlDeviceGetPersistenceMode,
        compat::nvmlDeviceGetComputeMode,
        compat::nvmlDeviceGetDisplayMode,
        compat::nvmlDeviceGetDisplayActive,
        compat::nvmlDeviceGetSerial,
        compat::nvmlDeviceGetVbiosVersion,
        compat::nvmlDeviceGetBoardPartNumber,
        compat::nvmlDeviceGetBrand,
        compat::nvmlDeviceGetArchitecture,
        compat::nvmlDeviceGetCudaComputeCapability,
        compat::nvmlDeviceGetPcieLinkMaxSpeed,
        compat::nvmlDeviceGetBAR1MemoryInfo,
        compat::nvmlDeviceGetEccMode,
        compat::nvmlDeviceGetTotalEccErrors,
        compat::nvmlDeviceGetCurrentClocksThrottleReasons,
        compat::nvmlDeviceGetCurrentClocksEventReasons,
    );
}

/// The pre-v2 names are only in the bindings with the `legacy-functions`
/// feature, which the tests (a dev-dependency) turn on.
#[cfg(test)]
fn legacy(lib: &NvmlLib) {
    check!(lib:
        system::nvmlInit,
        system::nvmlDeviceGetCount,
        system::nvmlDeviceGetHandleByIndex,
        processes::nvmlDeviceGetComputeRunningProcesses,
        processes::nvmlDeviceGetComputeRunningProcesses_v2,
        processes::nvmlDeviceGetGraphicsRunningProcesses,
        processes::nvmlDeviceGetGraphicsRunningProcesses_v2,
        processes::nvmlDeviceGetMPSComputeRunningProcesses,
        processes::nvmlDeviceGetMPSComputeRunningProcesses_v2,
        events::nvmlEventSetWait,
    );
}
