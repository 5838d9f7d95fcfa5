//! When to ship at once instead of at the end of the interval: the poll in
//! which a device's memory crosses the watermark from below. The collector's
//! rules then see the crossing within one fast poll, not one interval.

use std::collections::HashSet;

use crate::source::Poll;

#[derive(Debug)]
pub struct CrossingDetector {
    /// Fraction of total memory (used + reserved); above 1 disables it.
    threshold: f64,
    above: HashSet<String>,
}

impl CrossingDetector {
    pub fn new(threshold: f64) -> Self {
        Self {
            threshold,
            above: HashSet::new(),
        }
    }

    /// True when some device went from below to at-or-above the threshold
    /// since the previous poll. Staying above does not trigger again.
    pub fn crossed(&mut self, poll: &Poll) -> bool {
        let mut crossed = false;
        for d in &poll.devices {
            if d.memory_total == 0 {
                continue;
            }
            let fraction =
                d.memory_used.saturating_add(d.memory_reserved) as f64 / d.memory_total as f64;
            if fraction >= self.threshold {
                crossed |= self.above.insert(d.uuid.clone());
            } else {
                self.above.remove(&d.uuid);
            }
        }
        crossed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::DeviceReading;

    fn poll(used: &[(&str, u64)]) -> Poll {
        Poll {
            devices: used
                .iter()
                .map(|(uuid, used)| DeviceReading {
                    uuid: (*uuid).into(),
                    memory_used: *used,
                    memory_reserved: 5,
                    memory_total: 100,
                    utilization_pct: None,
                    pcie_tx_bytes_per_s: None,
                    pcie_rx_bytes_per_s: None,
                    health: None,
                })
                .collect(),
            processes: vec![],
            ..Poll::default()
        }
    }

    #[test]
    fn triggers_on_the_crossing_only() {
        let mut d = CrossingDetector::new(0.9);
        assert!(!d.crossed(&poll(&[("a", 80), ("b", 10)])));
        assert!(
            d.crossed(&poll(&[("a", 85), ("b", 10)])),
            "85 + 5 reserved = 90 %"
        );
        assert!(!d.crossed(&poll(&[("a", 95), ("b", 10)])), "still above");
        assert!(
            d.crossed(&poll(&[("a", 95), ("b", 90)])),
            "another device crosses"
        );
        assert!(!d.crossed(&poll(&[("a", 50), ("b", 90)])));
        assert!(
            d.crossed(&poll(&[("a", 88), ("b", 90)])),
            "a crosses again after falling"
        );
    }
}
