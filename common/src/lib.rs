//! What both Headroom daemons use, and nothing that ties one to the other:
//! systemd notify and watchdog, PEM loading, the Prometheus text exposition,
//! byte sizes in configuration files, the injectable clock, and how a
//! process's memory splits into weights, gradients, optimizer state,
//! activations and cache.

pub mod bytes;
pub mod clock;
pub mod composition;
pub mod exposition;
#[cfg(feature = "service")]
pub mod service;
pub mod tls;

pub use bytes::{ApproxBytes, ByteSize, HumanBytes};
pub use clock::Clock;
pub use composition::{Breakdown, Composition, Dtype, Part, Share};
