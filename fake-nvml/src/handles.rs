//! Device and event-set handles. `nvmlDevice_t` and `nvmlEventSet_t` are
//! opaque pointers that callers never dereference, so they carry plain
//! integers instead of addresses:
//!
//! ```text
//! device:     0x4844 << 48 | gpu index << 24 | generation << 8 | slot
//!             slot 0 = the whole GPU (generation 0),
//!             slot k = MIG instance k-1 of layout `generation`
//! event set:  0x4845 << 48 | set id (from 1)
//! ```
//!
//! The tag in the top 16 bits makes every value non-null and lets a stray
//! pointer be recognised as "not ours" (`NVML_ERROR_INVALID_ARGUMENT`).

use std::ptr;

use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlEventSet_t};

const DEVICE_TAG: u64 = 0x4844 << 48;
const EVENT_SET_TAG: u64 = 0x4845 << 48;
const TAG_MASK: u64 = 0xffff << 48;
const GPU_LIMIT: u64 = 1 << 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Device {
    Gpu(usize),
    Mig {
        gpu: usize,
        /// The MIG layout the handle was issued for (see `layout`).
        generation: usize,
        instance: usize,
    },
}

impl Device {
    pub(crate) fn gpu(self) -> usize {
        match self {
            Device::Gpu(gpu) | Device::Mig { gpu, .. } => gpu,
        }
    }

    /// `None` when the indices do not fit the encoding; config validation
    /// keeps every real GPU and instance within it.
    pub(crate) fn encode(self) -> Option<nvmlDevice_t> {
        let (gpu, generation, slot) = match self {
            Device::Gpu(gpu) => (gpu, 0, 0),
            Device::Mig {
                gpu,
                generation,
                instance,
            } => (gpu, generation, instance.checked_add(1)?),
        };
        let (gpu, generation, slot) = (gpu as u64, generation as u64, slot as u64);
        if gpu >= GPU_LIMIT || generation > 0xffff || slot > 0xff {
            return None;
        }
        let value = DEVICE_TAG | gpu << 24 | generation << 8 | slot;
        Some(ptr::without_provenance_mut(value as usize))
    }

    pub(crate) fn decode(handle: nvmlDevice_t) -> Option<Device> {
        let value = handle.addr() as u64;
        if value & TAG_MASK != DEVICE_TAG {
            return None;
        }
        let gpu = ((value >> 24) & (GPU_LIMIT - 1)) as usize;
        let generation = ((value >> 8) & 0xffff) as usize;
        match (value & 0xff) as usize {
            0 if generation == 0 => Some(Device::Gpu(gpu)),
            0 => None,
            slot => Some(Device::Mig {
                gpu,
                generation,
                instance: slot - 1,
            }),
        }
    }
}

pub(crate) fn encode_event_set(id: u32) -> nvmlEventSet_t {
    ptr::without_provenance_mut((EVENT_SET_TAG | u64::from(id)) as usize)
}

pub(crate) fn decode_event_set(handle: nvmlEventSet_t) -> Option<u32> {
    let value = handle.addr() as u64;
    (value & TAG_MASK == EVENT_SET_TAG)
        .then(|| u32::try_from(value & !TAG_MASK).ok())
        .flatten()
        .filter(|id| *id != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_round_trip_and_differ() {
        let cases = [
            Device::Gpu(0),
            Device::Gpu(7),
            Device::Mig {
                gpu: 0,
                generation: 0,
                instance: 0,
            },
            Device::Mig {
                gpu: 3,
                generation: 2,
                instance: 6,
            },
        ];
        let handles: Vec<nvmlDevice_t> = cases.iter().map(|d| d.encode().unwrap()).collect();
        for (device, handle) in cases.iter().zip(&handles) {
            assert!(!handle.is_null());
            assert_eq!(Device::decode(*handle), Some(*device));
        }
        for (i, a) in handles.iter().enumerate() {
            for b in &handles[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn foreign_values_are_rejected() {
        assert_eq!(Device::decode(ptr::null_mut()), None);
        assert_eq!(
            Device::decode(ptr::without_provenance_mut(0x7fff_1234_5678)),
            None
        );
        assert_eq!(Device::decode(encode_event_set(1).cast()), None);
        assert_eq!(
            decode_event_set(Device::Gpu(0).encode().unwrap().cast()),
            None
        );
        assert_eq!(decode_event_set(encode_event_set(9)), Some(9));
        assert_eq!(decode_event_set(ptr::null_mut()), None);
    }

    #[test]
    fn out_of_range_indices_do_not_encode() {
        assert_eq!(Device::Gpu(1 << 24).encode(), None);
        let too_many = Device::Mig {
            gpu: 0,
            generation: 0,
            instance: 255,
        };
        assert_eq!(too_many.encode(), None);
    }
}
