//! The running-process lists, in all three struct versions.
//!
//! nvml.h's protocol: the caller passes its array's capacity in
//! `*infoCount`; if the processes do not fit, `*infoCount` becomes the
//! number needed and the call returns `NVML_ERROR_INSUFFICIENT_SIZE`
//! (`infos = NULL`, `*infoCount = 0` is how callers ask for the count).
//! Otherwise the entries are written, `*infoCount` is their number, and the
//! call succeeds.
//!
//! Compute processes: on a GPU outside MIG mode its processes, with both
//! instance ids `0xFFFFFFFF`; on a GPU in MIG mode every instance's
//! processes with that instance's ids; on a MIG handle that instance's.
//! Graphics and MPS processes: always none.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlProcessInfo_t, nvmlProcessInfo_v1_t, nvmlProcessInfo_v2_t,
};

use crate::call::{self, Call};
use crate::ffi::{INSUFFICIENT_SIZE, NvmlResult, Out, nvmlReturn_t, out_slice};

/// NVML's "not in a MIG instance" instance id.
const NO_INSTANCE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Entry {
    pid: u32,
    used: u64,
    gpu_instance_id: u32,
    compute_instance_id: u32,
}

fn compute_processes(call: &Call) -> NvmlResult<Vec<Entry>> {
    let entry = |pid, used, gpu_instance_id, compute_instance_id| Entry {
        pid,
        used,
        gpu_instance_id,
        compute_instance_id,
    };
    if let Some(mig) = call.mig()? {
        let processes = mig.state.map_or(&[][..], |state| &state.processes);
        return Ok(processes
            .iter()
            .map(|p| {
                let (gi, ci) = (
                    mig.instance.gpu_instance_id,
                    mig.instance.compute_instance_id,
                );
                entry(p.pid, p.memory_used, gi, ci)
            })
            .collect());
    }
    let state = &call.gpu()?.state;
    let mut entries: Vec<Entry> = state
        .processes
        .iter()
        .map(|p| entry(p.pid, p.memory_used, NO_INSTANCE, NO_INSTANCE))
        .collect();
    let bogus = call
        .host
        .faults
        .bogus_processes(call.gpu_index(), call.now.t);
    entries.extend(bogus.map(|b| entry(b.pid, b.memory, NO_INSTANCE, NO_INSTANCE)));
    for (instance, mig_state) in call.instances()?.iter().zip(&state.mig) {
        entries.extend(mig_state.processes.iter().map(|p| {
            let (gi, ci) = (instance.gpu_instance_id, instance.compute_instance_id);
            entry(p.pid, p.memory_used, gi, ci)
        }));
    }
    Ok(entries)
}

/// Writes `entries` into the caller's array per the protocol above.
///
/// # Safety
///
/// `info_count` must be null or point to the caller's capacity; `infos` must
/// be null or valid for writes of that many `T`s.
unsafe fn answer<T>(
    info_count: *mut c_uint,
    infos: *mut T,
    entries: &[Entry],
    convert: fn(&Entry) -> T,
) -> NvmlResult {
    // SAFETY: an nvml.h in/out-parameter.
    let count = unsafe { Out::new(info_count) }?;
    let capacity = if infos.is_null() {
        0
    } else {
        // SAFETY: non-null; nvml.h has the caller store its array's capacity
        // there before the call.
        unsafe { count.as_ptr().read() as usize }
    };
    count.set(c_uint::try_from(entries.len()).unwrap_or(c_uint::MAX));
    if entries.is_empty() {
        return Ok(());
    }
    if entries.len() > capacity {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `infos` holds `capacity >= entries.len()` elements per this
    // function's contract.
    let slots = unsafe { out_slice(infos, entries.len()) }?;
    for (slot, entry) in slots.iter_mut().zip(entries) {
        slot.write(convert(entry));
    }
    Ok(())
}

fn v1(entry: &Entry) -> nvmlProcessInfo_v1_t {
    nvmlProcessInfo_v1_t {
        pid: entry.pid,
        usedGpuMemory: entry.used,
    }
}

fn v2(entry: &Entry) -> nvmlProcessInfo_v2_t {
    nvmlProcessInfo_v2_t {
        pid: entry.pid,
        usedGpuMemory: entry.used,
        gpuInstanceId: entry.gpu_instance_id,
        computeInstanceId: entry.compute_instance_id,
    }
}

/// One export per (list, struct version): `compute` lists the scenario's
/// processes, `none` lists nothing.
macro_rules! process_lists {
    ($(fn $name:ident($info:ty) = $list:ident, $convert:ident;)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            info_count: *mut c_uint,
            infos: *mut $info,
        ) -> nvmlReturn_t {
            call::device(stringify!($name), device, |call| {
                let entries = $list(call)?;
                // SAFETY: the caller's count and array, per nvml.h.
                unsafe { answer(info_count, infos, &entries, $convert) }
            })
        }
    )*};
}

fn none(_: &Call) -> NvmlResult<Vec<Entry>> {
    Ok(Vec::new())
}

process_lists! {
    fn nvmlDeviceGetComputeRunningProcesses_v3(nvmlProcessInfo_t) = compute_processes, v2;
    fn nvmlDeviceGetComputeRunningProcesses_v2(nvmlProcessInfo_v2_t) = compute_processes, v2;
    fn nvmlDeviceGetComputeRunningProcesses(nvmlProcessInfo_v1_t) = compute_processes, v1;
    fn nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlProcessInfo_t) = none, v2;
    fn nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlProcessInfo_v2_t) = none, v2;
    fn nvmlDeviceGetGraphicsRunningProcesses(nvmlProcessInfo_v1_t) = none, v1;
    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlProcessInfo_t) = none, v2;
    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlProcessInfo_v2_t) = none, v2;
    fn nvmlDeviceGetMPSComputeRunningProcesses(nvmlProcessInfo_v1_t) = none, v1;
}
