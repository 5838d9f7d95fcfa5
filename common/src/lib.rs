//! What both Headroom daemons use, and nothing that ties one to the other:
//! systemd notify and watchdog, PEM loading, the Prometheus text exposition,
//! byte sizes in configuration files, and the injectable clock.

pub mod bytes;
pub mod clock;
pub mod exposition;
#[cfg(feature = "service")]
pub mod service;
pub mod tls;

pub use bytes::{ByteSize, HumanBytes};
pub use clock::Clock;
