//! Event sets and the XID events of `[[xid]]` faults.
//!
//! Only `nvmlEventTypeXidCriticalError` is supported. An XID fault is
//! delivered once to each event set that registered for XIDs on its GPU at
//! or before the fault's time; an XID due at or after the GPU is lost is
//! never delivered (a lost GPU reports nothing).

use std::collections::{HashMap, HashSet};
use std::ffi::{c_uint, c_ulonglong};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlEventTypeXidCriticalError,
};

use crate::call;
use crate::config::Faults;
use crate::ffi::{
    INVALID_ARGUMENT, NOT_SUPPORTED, NvmlResult, Out, TIMEOUT, UNINITIALIZED, guard, nvmlReturn_t,
};
use crate::handles::{self, Device};
use crate::host::{self, Host};

const SUPPORTED_EVENTS: c_ulonglong = nvmlEventTypeXidCriticalError as c_ulonglong;
/// A waiter re-checks at least this often (for a freed set or a shutdown).
const WAIT_SLICE: Duration = Duration::from_millis(50);

#[derive(Debug)]
pub(crate) struct Registry {
    sets: Mutex<HashMap<u32, EventSet>>,
    next_id: AtomicU32,
    /// Indices into `Faults::xid`, earliest first.
    schedule: Vec<usize>,
}

#[derive(Debug, Default)]
struct EventSet {
    /// GPU index → scenario time it was registered for XIDs.
    xid_since: HashMap<usize, f64>,
    /// Indices into `Faults::xid` already delivered to this set.
    delivered: HashSet<usize>,
}

/// An XID ready for a set, or when the next one will be.
enum Due {
    Now(usize),
    At(f64),
    Never,
}

impl Registry {
    pub(crate) fn new(faults: &Faults) -> Registry {
        let mut schedule: Vec<usize> = (0..faults.xid.len()).collect();
        schedule.sort_by(|a, b| faults.xid[*a].at_s.total_cmp(&faults.xid[*b].at_s));
        Registry {
            sets: Mutex::new(HashMap::new()),
            next_id: AtomicU32::new(1),
            schedule,
        }
    }

    fn sets(&self) -> std::sync::MutexGuard<'_, HashMap<u32, EventSet>> {
        self.sets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn due(&self, faults: &Faults, set: &EventSet, t: f64) -> Due {
        let mut next = Due::Never;
        for &index in &self.schedule {
            let Some(xid) = faults.xid.get(index) else {
                continue;
            };
            let gpu = xid.gpu as usize;
            let registered = set
                .xid_since
                .get(&gpu)
                .is_some_and(|since| *since <= xid.at_s);
            let lost_first = faults.lost_since(gpu).is_some_and(|lost| lost <= xid.at_s);
            if !registered || lost_first || set.delivered.contains(&index) {
                continue;
            }
            if xid.at_s <= t {
                return Due::Now(index);
            }
            if matches!(next, Due::Never) {
                next = Due::At(xid.at_s);
            }
        }
        next
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        // SAFETY: an nvml.h out-parameter.
        let set = unsafe { Out::new(set) }?;
        let id = host.events.next_id.fetch_add(1, Ordering::Relaxed);
        host.events.sets().insert(id, EventSet::default());
        set.set(handles::encode_event_set(id));
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        let id = handles::decode_event_set(set).ok_or(INVALID_ARGUMENT)?;
        host.events
            .sets()
            .remove(&id)
            .map(drop)
            .ok_or(INVALID_ARGUMENT)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    event_types: *mut c_ulonglong,
) -> nvmlReturn_t {
    call::device("nvmlDeviceGetSupportedEventTypes", device, |call| {
        // SAFETY: an nvml.h out-parameter.
        let event_types = unsafe { Out::new(event_types) }?;
        if matches!(call.device, Device::Mig { .. }) {
            return Err(NOT_SUPPORTED);
        }
        event_types.set(SUPPORTED_EVENTS);
        Ok(())
    })
}

/// Registers `event_types` on a whole GPU; any unsupported bit makes the
/// call `NVML_ERROR_NOT_SUPPORTED`, as in NVIDIA's library.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    event_types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    call::device("nvmlDeviceRegisterEvents", device, |call| {
        let id = handles::decode_event_set(set).ok_or(INVALID_ARGUMENT)?;
        if matches!(call.device, Device::Mig { .. }) || event_types & !SUPPORTED_EVENTS != 0 {
            return Err(NOT_SUPPORTED);
        }
        let mut sets = call.host.events.sets();
        let set = sets.get_mut(&id).ok_or(INVALID_ARGUMENT)?;
        if event_types & SUPPORTED_EVENTS != 0 {
            set.xid_since.entry(call.gpu_index()).or_insert(call.now.t);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let host = host::get()?;
        // SAFETY: an nvml.h out-parameter.
        let data = unsafe { Out::new(data) }?;
        let id = handles::decode_event_set(set).ok_or(INVALID_ARGUMENT)?;
        wait(host, id, &data, Duration::from_millis(u64::from(timeoutms)))
    })
}

/// The pre-v2 name; same arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    // SAFETY: the same contract as nvmlEventSetWait_v2's.
    unsafe { nvmlEventSetWait_v2(set, data, timeoutms) }
}

/// Blocks until an XID is due for the set (delivering it) or `timeout`
/// passes (`NVML_ERROR_TIMEOUT`).
fn wait(host: &Host, id: u32, data: &Out<nvmlEventData_t>, timeout: Duration) -> NvmlResult {
    let deadline = Instant::now().checked_add(timeout);
    loop {
        if !host::is_initialized() {
            return Err(UNINITIALIZED);
        }
        let t = host.now();
        let next = {
            let mut sets = host.events.sets();
            let set = sets.get_mut(&id).ok_or(INVALID_ARGUMENT)?;
            match host.events.due(&host.faults, set, t) {
                Due::Now(index) => {
                    set.delivered.insert(index);
                    let xid = host.faults.xid.get(index).ok_or(INVALID_ARGUMENT)?;
                    let device = Device::Gpu(xid.gpu as usize).encode();
                    data.set(nvmlEventData_t {
                        device: device.ok_or(INVALID_ARGUMENT)?,
                        eventType: SUPPORTED_EVENTS,
                        eventData: xid.xid,
                        gpuInstanceId: xid.gpu_instance_id,
                        computeInstanceId: xid.compute_instance_id,
                    });
                    return Ok(());
                }
                Due::At(at) => Duration::try_from_secs_f64(at - t).ok(),
                Due::Never => None,
            }
        };
        let left = match deadline {
            Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => left,
                _ => return Err(TIMEOUT),
            },
            None => WAIT_SLICE,
        };
        let nap = next.map_or(left, |next| next.min(left)).min(WAIT_SLICE);
        thread::sleep(nap.max(Duration::from_millis(1)));
    }
}
