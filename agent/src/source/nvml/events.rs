//! XID errors arrive through an NVML event set, which blocks in
//! `nvmlEventSetWait`; it gets a thread of its own so polling never waits
//! for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;

use crate::source::{EventKind, SourceEvent};

use super::pcie::sleep_unless_stopped;

/// How long one wait blocks; bounds how long a stop takes.
const WAIT_MS: u32 = 200;

/// Listens for XID errors on GPUs `indices` until `stop` is set. GPUs that
/// cannot deliver XID events are skipped with a log line; if none can, the
/// thread ends at once.
pub(crate) fn spawn(
    nvml: Arc<Nvml>,
    indices: Vec<u32>,
    events: Sender<SourceEvent>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("headroom-nvml-events".into())
        .spawn(move || listen(&nvml, &indices, &events, &stop))
}

fn listen(nvml: &Nvml, indices: &[u32], events: &Sender<SourceEvent>, stop: &AtomicBool) {
    let mut set = match nvml.create_event_set() {
        Ok(set) => set,
        Err(error) => {
            tracing::warn!(%error, "XID events unavailable: cannot create an NVML event set");
            return;
        }
    };
    let mut registered = 0;
    for &index in indices {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        let supported = device
            .supported_event_types()
            .is_ok_and(|t| t.contains(EventTypes::CRITICAL_XID_ERROR));
        if !supported {
            tracing::info!(gpu = index, "GPU does not report XID events");
            continue;
        }
        set = match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(set) => {
                registered += 1;
                set
            }
            Err(error) => {
                // NVML frees the set on this path; without one we cannot go on.
                tracing::warn!(gpu = index, error = %error.error, "cannot register for XID events");
                return;
            }
        };
    }
    if registered == 0 {
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        match set.wait(WAIT_MS) {
            Ok(data) => {
                if !data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    continue;
                }
                let code = match data.event_data {
                    Some(XidError::Value(xid)) => u32::try_from(xid).unwrap_or(u32::MAX),
                    Some(XidError::Unknown) | None => 0,
                };
                let uuid = data.device.uuid().unwrap_or_default();
                tracing::warn!(gpu = %uuid, xid = code, "XID error");
                let event = SourceEvent {
                    code,
                    ..SourceEvent::now(EventKind::Xid, uuid, format!("XID {code}"))
                };
                if events.send(event).is_err() {
                    return;
                }
            }
            Err(NvmlError::Timeout) => {}
            // A lost GPU shows up here as well as in its poll; back off so a
            // persistent error does not spin.
            Err(_) => sleep_unless_stopped(Duration::from_millis(500), stop),
        }
    }
}
