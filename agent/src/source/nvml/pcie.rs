//! PCIe bandwidth. NVML's cumulative byte counters (fields 197/198) cost one
//! cheap call per poll and give exact rates from deltas; where a GPU does not
//! support them, `nvmlDeviceGetPcieThroughput` (a 20 ms sampling call per
//! direction) runs on a thread of its own at a slower cadence, so it never
//! delays memory polling.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::PcieUtilCounter;

/// Turns successive readings of a cumulative byte counter into a rate.
#[derive(Debug, Default, Clone)]
pub(crate) struct CounterRate {
    last: Option<(u64, i64)>,
}

impl CounterRate {
    /// `value` is the counter, `at_us` the time NVML read it (µs). The first
    /// reading gives no rate; a counter that wrapped past `u64::MAX` still
    /// gives the true delta. A reading no newer than the last gives none.
    pub(crate) fn update(&mut self, value: u64, at_us: i64) -> Option<u64> {
        let previous = self.last.replace((value, at_us));
        let (last_value, last_at) = previous?;
        let elapsed_us = at_us.checked_sub(last_at).filter(|d| *d > 0)?;
        let delta = u128::from(value.wrapping_sub(last_value));
        let rate = delta * 1_000_000 / u128::from(elapsed_us.unsigned_abs());
        Some(u64::try_from(rate).unwrap_or(u64::MAX))
    }
}

/// (tx, rx) in bytes/s; either may be unknown.
pub(crate) type Rates = (Option<u64>, Option<u64>);

/// Latest fallback throughput per GPU index.
#[derive(Debug, Default)]
pub(crate) struct ThroughputBoard {
    wanted: Mutex<Vec<u32>>,
    latest: Mutex<HashMap<u32, Rates>>,
}

impl ThroughputBoard {
    /// Asks the fallback thread to sample GPU `index` from now on.
    pub(crate) fn want(&self, index: u32) {
        if let Ok(mut wanted) = self.wanted.lock()
            && !wanted.contains(&index)
        {
            wanted.push(index);
        }
    }

    /// (tx, rx) bytes/s from the last fallback sample of GPU `index`.
    pub(crate) fn latest(&self, index: u32) -> Rates {
        self.latest
            .lock()
            .ok()
            .and_then(|latest| latest.get(&index).copied())
            .unwrap_or((None, None))
    }

    fn wanted(&self) -> Vec<u32> {
        self.wanted.lock().map(|w| w.clone()).unwrap_or_default()
    }

    fn publish(&self, index: u32, rates: Rates) {
        if let Ok(mut latest) = self.latest.lock() {
            latest.insert(index, rates);
        }
    }
}

/// Samples `nvmlDeviceGetPcieThroughput` for the GPUs on `board` every
/// `every` until `stop` is set.
pub(crate) fn spawn_fallback(
    nvml: Arc<Nvml>,
    board: Arc<ThroughputBoard>,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("headroom-nvml-pcie".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for index in board.wanted() {
                    let Ok(device) = nvml.device_by_index(index) else {
                        board.publish(index, (None, None));
                        continue;
                    };
                    // NVML answers in KB/s.
                    let read = |counter| {
                        device
                            .pcie_throughput(counter)
                            .ok()
                            .map(|kb| u64::from(kb) * 1024)
                    };
                    let rates = (read(PcieUtilCounter::Send), read(PcieUtilCounter::Receive));
                    board.publish(index, rates);
                }
                sleep_unless_stopped(every, &stop);
            }
        })
}

/// Sleeps in short steps so that a stop is noticed within 50 ms.
pub(crate) fn sleep_unless_stopped(total: Duration, stop: &AtomicBool) {
    let step = Duration::from_millis(50);
    let mut left = total;
    while !left.is_zero() && !stop.load(Ordering::Relaxed) {
        let now = step.min(left);
        std::thread::sleep(now);
        left -= now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reading_gives_no_rate_then_deltas_do() {
        let mut rate = CounterRate::default();
        assert_eq!(rate.update(1_000, 0), None);
        assert_eq!(rate.update(3_000, 1_000_000), Some(2_000));
        assert_eq!(rate.update(3_500, 1_500_000), Some(1_000));
    }

    #[test]
    fn a_counter_that_wraps_gives_the_true_delta() {
        let mut rate = CounterRate::default();
        rate.update(u64::MAX - 99, 0);
        assert_eq!(rate.update(100, 1_000_000), Some(200));
    }

    #[test]
    fn a_reading_that_is_not_newer_gives_no_rate() {
        let mut rate = CounterRate::default();
        rate.update(10, 5_000);
        assert_eq!(rate.update(20, 5_000), None);
        assert_eq!(rate.update(30, 4_000), None);
        assert_eq!(rate.update(130, 5_000), Some(100_000));
    }
}
