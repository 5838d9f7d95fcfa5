//! Who this agent is: node name and boot id.

use rand::Rng;

/// The host name, from the kernel.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// The kernel's boot id, which changes on every boot of the host.
pub fn kernel_boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// A fresh id for one agent run. Used where sequence numbers do not survive a
/// restart (no persistent spool), so that a restarted agent's batches are
/// never mistaken for replays of the previous run's.
pub fn random_run_id() -> String {
    let bits: u128 = rand::rng().random();
    format!("{bits:032x}")
}
