//! Who this agent is: node name and stream id.

use rand::Rng;

/// The host name, from the kernel.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// A fresh stream id: for each run of an agent without a spool, and for each
/// new spool. Sequence numbers start again at 1 in a new stream, so it must
/// never be one the collector has seen.
pub fn random_run_id() -> String {
    let bits: u128 = rand::rng().random();
    format!("{bits:032x}")
}
