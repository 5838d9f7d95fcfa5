//! Folds fast polls (10 Hz by default) into one sample per interval (1 s by
//! default). Memory keeps last, min and max, so a spike that rises and falls
//! between two shipments still reaches the collector.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::source::{Inventory, Poll, ProcessReading, SourceEvent};

/// One interval of one GPU or MIG instance.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSample {
    pub uuid: String,
    pub timestamp_ms: i64,
    pub interval_ms: u32,
    pub poll_count: u32,
    pub memory_used_last: u64,
    pub memory_used_min: u64,
    pub memory_used_max: u64,
    pub memory_reserved: u64,
    pub memory_total: u64,
    pub utilization_pct: Option<u32>,
    pub pcie_tx_bytes_per_s: Option<u64>,
    pub pcie_rx_bytes_per_s: Option<u64>,
}

/// One interval of one process on one device: its last reading and the most
/// memory it held at any poll in the interval.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessSample {
    pub timestamp_ms: i64,
    pub last: ProcessReading,
    pub memory_used_max: u64,
}

/// What one interval produced, ready to ship.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IntervalSamples {
    pub gpus: Vec<GpuSample>,
    pub processes: Vec<ProcessSample>,
    pub events: Vec<SourceEvent>,
    /// The node's new inventory, when it changed during the interval.
    pub inventory: Option<Inventory>,
}

#[derive(Debug)]
struct DeviceFold {
    polls: u32,
    used_last: u64,
    used_min: u64,
    used_max: u64,
    reserved: u64,
    total: u64,
    utilization: MeanFold,
    pcie_tx: MeanFold,
    pcie_rx: MeanFold,
}

/// Mean of the readings a device gave; rates and utilisation are averages over
/// the interval, not a snapshot of its last poll.
#[derive(Debug, Default)]
struct MeanFold {
    sum: u128,
    count: u32,
}

impl MeanFold {
    fn add(&mut self, value: Option<u64>) {
        if let Some(v) = value {
            self.sum += u128::from(v);
            self.count += 1;
        }
    }

    fn mean(&self) -> Option<u64> {
        (self.count > 0).then(|| {
            let mean = (self.sum + u128::from(self.count) / 2) / u128::from(self.count);
            u64::try_from(mean).unwrap_or(u64::MAX)
        })
    }
}

/// A process on one device: (pid, start time).
type ProcessKey = (u32, i64);

#[derive(Debug, Default)]
pub struct SampleWindow {
    devices: BTreeMap<String, DeviceFold>,
    /// Keyed by device first, so a poll finds its entries by `&str` without
    /// building a key per process (hundreds per poll at 10 Hz).
    processes: HashMap<Arc<str>, BTreeMap<ProcessKey, (ProcessReading, u64)>>,
    events: Vec<SourceEvent>,
    inventory: Option<Inventory>,
}

impl SampleWindow {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn observe(&mut self, poll: &Poll) {
        self.events.extend(poll.events.iter().cloned());
        if let Some(inventory) = &poll.inventory {
            self.inventory = Some(inventory.clone());
        }
        for d in &poll.devices {
            let fold = self
                .devices
                .entry(d.uuid.clone())
                .or_insert_with(|| DeviceFold {
                    polls: 0,
                    used_last: d.memory_used,
                    used_min: d.memory_used,
                    used_max: d.memory_used,
                    reserved: d.memory_reserved,
                    total: d.memory_total,
                    utilization: MeanFold::default(),
                    pcie_tx: MeanFold::default(),
                    pcie_rx: MeanFold::default(),
                });
            fold.polls += 1;
            fold.used_last = d.memory_used;
            fold.used_min = fold.used_min.min(d.memory_used);
            fold.used_max = fold.used_max.max(d.memory_used);
            fold.reserved = d.memory_reserved;
            fold.total = d.memory_total;
            fold.utilization.add(d.utilization_pct.map(u64::from));
            fold.pcie_tx.add(d.pcie_tx_bytes_per_s);
            fold.pcie_rx.add(d.pcie_rx_bytes_per_s);
        }
        // A source lists a device's processes together: look the device up
        // once per run of them, not once per process.
        for run in poll
            .processes
            .chunk_by(|a, b| Arc::ptr_eq(&a.device_uuid, &b.device_uuid))
        {
            let Some(first) = run.first() else { continue };
            let on_device = match self.processes.get_mut(&*first.device_uuid) {
                Some(on_device) => on_device,
                None => self.processes.entry(first.device_uuid.clone()).or_default(),
            };
            for p in run {
                match on_device.get_mut(&(p.pid, p.start_time_ms)) {
                    Some((last, max)) => {
                        *max = (*max).max(p.memory_used);
                        update(last, p);
                    }
                    None => {
                        on_device.insert((p.pid, p.start_time_ms), (p.clone(), p.memory_used));
                    }
                }
            }
        }
    }

    /// True when no poll landed in the current interval.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
            && self.processes.is_empty()
            && self.events.is_empty()
            && self.inventory.is_none()
    }

    /// Closes the interval of `interval_ms` ending at `end_ms` and starts a
    /// new one. A process that exited during the interval is still reported
    /// with what it held.
    pub fn finish(&mut self, end_ms: i64, interval_ms: u32) -> IntervalSamples {
        let gpus = std::mem::take(&mut self.devices)
            .into_iter()
            .map(|(uuid, f)| GpuSample {
                uuid,
                timestamp_ms: end_ms,
                interval_ms,
                poll_count: f.polls,
                memory_used_last: f.used_last,
                memory_used_min: f.used_min,
                memory_used_max: f.used_max,
                memory_reserved: f.reserved,
                memory_total: f.total,
                utilization_pct: f
                    .utilization
                    .mean()
                    .map(|u| u32::try_from(u).unwrap_or(100)),
                pcie_tx_bytes_per_s: f.pcie_tx.mean(),
                pcie_rx_bytes_per_s: f.pcie_rx.mean(),
            })
            .collect();
        let mut processes: Vec<ProcessSample> = std::mem::take(&mut self.processes)
            .into_values()
            .flat_map(BTreeMap::into_values)
            .map(|(last, max)| ProcessSample {
                timestamp_ms: end_ms,
                last,
                memory_used_max: max,
            })
            .collect();
        processes.sort_by(|a, b| {
            (&a.last.device_uuid, a.last.pid).cmp(&(&b.last.device_uuid, b.last.pid))
        });
        IntervalSamples {
            gpus,
            processes,
            events: std::mem::take(&mut self.events),
            inventory: self.inventory.take(),
        }
    }
}

/// The newest reading of a process; its owner is shared, not copied.
fn update(last: &mut ProcessReading, p: &ProcessReading) {
    last.memory_used = p.memory_used;
    if p.allocator.is_some() {
        last.allocator = p.allocator;
    }
    if !Arc::ptr_eq(&last.owner, &p.owner) {
        last.owner = p.owner.clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{DeviceReading, ProcessOwner};

    fn device(used: u64, util: Option<u32>) -> DeviceReading {
        DeviceReading {
            uuid: "GPU-a".into(),
            memory_used: used,
            memory_reserved: 10,
            memory_total: 1000,
            utilization_pct: util,
            pcie_tx_bytes_per_s: Some(100),
            pcie_rx_bytes_per_s: None,
            health: None,
        }
    }

    fn process(pid: u32, used: u64) -> ProcessReading {
        ProcessReading {
            device_uuid: "GPU-a".into(),
            pid,
            start_time_ms: 5,
            memory_used: used,
            owner: Arc::new(ProcessOwner {
                name: "train".into(),
                uid: 1000,
                user: "alice".into(),
                slurm_job_id: "77".into(),
                ..ProcessOwner::default()
            }),
            allocator: None,
        }
    }

    #[test]
    fn spike_between_shipments_survives_as_max() {
        let mut w = SampleWindow::new();
        for used in [100, 900, 120] {
            w.observe(&Poll {
                devices: vec![device(used, Some(50))],
                processes: vec![],
                ..Poll::default()
            });
        }
        let s = w.finish(42, 1000);
        assert_eq!(s.gpus.len(), 1);
        let g = &s.gpus[0];
        assert_eq!(
            (g.memory_used_last, g.memory_used_min, g.memory_used_max),
            (120, 100, 900)
        );
        assert_eq!(g.poll_count, 3);
        assert_eq!(g.timestamp_ms, 42);
        assert_eq!(g.pcie_tx_bytes_per_s, Some(100));
        assert_eq!(g.pcie_rx_bytes_per_s, None);
    }

    #[test]
    fn utilisation_is_the_mean_of_the_polls() {
        let mut w = SampleWindow::new();
        for util in [Some(10), None, Some(31)] {
            w.observe(&Poll {
                devices: vec![device(1, util)],
                processes: vec![],
                ..Poll::default()
            });
        }
        assert_eq!(w.finish(1, 1000).gpus[0].utilization_pct, Some(21));
    }

    #[test]
    fn process_that_exits_mid_interval_is_still_reported_with_its_peak() {
        let mut w = SampleWindow::new();
        w.observe(&Poll {
            devices: vec![],
            processes: vec![process(1, 300), process(2, 5)],
            ..Poll::default()
        });
        w.observe(&Poll {
            devices: vec![],
            processes: vec![process(1, 200)],
            ..Poll::default()
        });
        let s = w.finish(9, 1000);
        assert_eq!(s.processes.len(), 2);
        assert_eq!(s.processes[0].last.memory_used, 200);
        assert_eq!(s.processes[0].memory_used_max, 300);
        assert_eq!(s.processes[1].last.pid, 2);
    }

    #[test]
    fn finish_starts_a_fresh_interval() {
        let mut w = SampleWindow::new();
        w.observe(&Poll {
            devices: vec![device(500, None)],
            processes: vec![process(1, 1)],
            ..Poll::default()
        });
        w.finish(1, 1000);
        assert!(w.is_empty());
        w.observe(&Poll {
            devices: vec![device(7, None)],
            processes: vec![],
            ..Poll::default()
        });
        let s = w.finish(2, 1000);
        assert_eq!(s.gpus[0].memory_used_max, 7);
        assert!(s.processes.is_empty());
    }
}
