//! PCIe traffic: the cumulative byte counters behind field values 197/198
//! (`NVML_FI_DEV_PCIE_COUNT_TX_BYTES`/`RX_BYTES`) and the instantaneous
//! `nvmlDeviceGetPcieThroughput`.

use std::ffi::{c_int, c_uint};

use nvml_wrapper_sys::bindings::field_id::{
    NVML_FI_DEV_PCIE_COUNT_RX_BYTES, NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlFieldValue_t, nvmlPcieUtilCounter_enum_NVML_PCIE_UTIL_RX_BYTES,
    nvmlPcieUtilCounter_enum_NVML_PCIE_UTIL_TX_BYTES, nvmlPcieUtilCounter_t, nvmlValue_t,
    nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
};

use crate::call::{self, Call};
use crate::ffi::{
    INVALID_ARGUMENT, NOT_SUPPORTED, NvmlResult, Out, SUCCESS, nvmlReturn_t, out_slice,
};
use crate::handles::Device;

const PCIE_UTIL_TX_BYTES: nvmlPcieUtilCounter_t = nvmlPcieUtilCounter_enum_NVML_PCIE_UTIL_TX_BYTES;
const PCIE_UTIL_RX_BYTES: nvmlPcieUtilCounter_t = nvmlPcieUtilCounter_enum_NVML_PCIE_UTIL_RX_BYTES;

/// Fills each requested field. Fields 197/198 on a whole GPU give the
/// cumulative bytes (unless a `[[pcie_counters_unsupported]]` fault says
/// otherwise); every other field, and every field on a MIG handle, gets a
/// per-field `NVML_ERROR_NOT_SUPPORTED`. The call itself succeeds.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    values_count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetFieldValues", device, |call| {
        let count = usize::try_from(values_count).map_err(|_| INVALID_ARGUMENT)?;
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller's array of `values_count` entries, per nvml.h.
        let slots = unsafe { out_slice(values, count) }?;
        let timestamp = call.host.unix_us(call.now.t);
        for slot in slots {
            // SAFETY: the caller set `fieldId` and `scopeId` of every entry
            // before the call (nvml.h); only those two fields are read.
            let (field_id, scope_id) = unsafe {
                let entry = slot.as_ptr();
                (
                    (&raw const (*entry).fieldId).read(),
                    (&raw const (*entry).scopeId).read(),
                )
            };
            let (code, bytes) = match counter(call, field_id) {
                Ok(bytes) => (SUCCESS, bytes),
                Err(code) => (code, 0),
            };
            slot.write(nvmlFieldValue_t {
                fieldId: field_id,
                scopeId: scope_id,
                timestamp,
                latencyUsec: 0,
                valueType: nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                nvmlReturn: code,
                value: nvmlValue_t { ullVal: bytes },
            });
        }
        Ok(())
    })
}

fn counter(call: &Call, field_id: c_uint) -> NvmlResult<u64> {
    if matches!(call.device, Device::Mig { .. })
        || call.host.faults.pcie_counters_unsupported(call.gpu_index())
    {
        return Err(NOT_SUPPORTED);
    }
    let gpu = call.gpu()?;
    match field_id {
        NVML_FI_DEV_PCIE_COUNT_TX_BYTES => Ok(gpu.pcie_tx_bytes),
        NVML_FI_DEV_PCIE_COUNT_RX_BYTES => Ok(gpu.pcie_rx_bytes),
        _ => Err(NOT_SUPPORTED),
    }
}

/// The scenario's current rate in KB/s (bytes / 1024), as NVML reports it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieThroughput(
    device: nvmlDevice_t,
    counter: nvmlPcieUtilCounter_t,
    value: *mut c_uint,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetPcieThroughput", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let value = unsafe { Out::new(value) }?;
        if matches!(call.device, Device::Mig { .. }) {
            return Err(NOT_SUPPORTED);
        }
        let state = &call.gpu()?.state;
        let rate = match counter {
            PCIE_UTIL_TX_BYTES => state.pcie_tx_bytes_per_s,
            PCIE_UTIL_RX_BYTES => state.pcie_rx_bytes_per_s,
            _ => return Err(INVALID_ARGUMENT),
        };
        value.set(c_uint::try_from(rate / 1024).unwrap_or(c_uint::MAX));
        Ok(())
    })
}
