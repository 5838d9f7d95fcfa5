//! Allocator statistics that training processes report about themselves
//! (PyTorch's caching allocator, through `clients/python`). NVML says how
//! much a process holds; only the process knows how much of that is live
//! tensors, how much is cache too fragmented to reuse, and how often the
//! allocator had to flush that cache to find memory.
//!
//! Reports arrive on a Unix socket ([`listener`]); the newest one per
//! process waits in [`AllocatorReports`] until the sampler joins it to that
//! process's NVML samples at the end of an interval.

pub mod listener;
pub mod report;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use report::{AllocatorStats, DeviceReport};

use crate::window::ProcessSample;

/// A report older than this is not joined: the process stopped reporting.
const DEFAULT_FRESH_FOR: Duration = Duration::from_secs(5);
/// Start times from two reads of /proc may differ by the rounding of
/// clock ticks and a drifting boot time; a reused pid starts much later.
const START_TIME_TOLERANCE_MS: i64 = 2_000;

#[derive(Debug)]
struct Latest {
    /// The connection that sent it, so a closed connection withdraws only
    /// its own report.
    connection: u64,
    /// When the connecting process started (epoch ms), so a report is never
    /// joined to a later process that reuses the pid.
    start_time_ms: Option<i64>,
    received: Instant,
    devices: Vec<DeviceReport>,
}

/// Who sent a report, as the kernel and /proc say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sender {
    pub pid: u32,
    pub start_time_ms: Option<i64>,
    pub connection: u64,
}

/// The newest report of every process currently reporting, by host pid.
#[derive(Debug)]
pub struct AllocatorReports {
    latest: Mutex<HashMap<u32, Latest>>,
    fresh_for: Duration,
}

impl Default for AllocatorReports {
    fn default() -> Self {
        Self::new(DEFAULT_FRESH_FOR)
    }
}

impl AllocatorReports {
    pub fn new(fresh_for: Duration) -> Self {
        Self {
            latest: Mutex::default(),
            fresh_for,
        }
    }

    /// Records a verified report under the sender's host pid as the kernel
    /// gave it, never the pid the report claims.
    pub fn record(&self, sender: Sender, devices: Vec<DeviceReport>) {
        if let Ok(mut latest) = self.latest.lock() {
            latest.insert(
                sender.pid,
                Latest {
                    connection: sender.connection,
                    start_time_ms: sender.start_time_ms,
                    received: Instant::now(),
                    devices,
                },
            );
        }
    }

    /// The connection closed: its process stopped reporting (or exited).
    pub fn forget(&self, pid: u32, connection: u64) {
        if let Ok(mut latest) = self.latest.lock()
            && latest.get(&pid).is_some_and(|l| l.connection == connection)
        {
            latest.remove(&pid);
        }
    }

    /// Processes with a report, stale ones included until they are dropped.
    pub fn len(&self) -> usize {
        self.latest.lock().map_or(0, |l| l.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Gives each process sample the allocator counters its process reported
    /// for that device (samples without a report keep what they had). A device entry matches by UUID; one without a UUID
    /// matches when the process reported one device and NVML shows it on
    /// exactly one. Stale reports are dropped here.
    pub fn attach(&self, samples: &mut [ProcessSample]) {
        let Ok(mut latest) = self.latest.lock() else {
            return;
        };
        if latest.is_empty() {
            return;
        }
        let now = Instant::now();
        latest.retain(|_, l| now.duration_since(l.received) <= self.fresh_for);
        let mut devices_per_pid: HashMap<u32, usize> = HashMap::new();
        for s in samples.iter() {
            if latest.contains_key(&s.last.pid) {
                *devices_per_pid.entry(s.last.pid).or_default() += 1;
            }
        }
        for s in samples.iter_mut() {
            let Some(report) = latest.get(&s.last.pid) else {
                continue;
            };
            if let Some(started) = report.start_time_ms
                && s.last.start_time_ms != 0
                && (started - s.last.start_time_ms).abs() > START_TIME_TOLERANCE_MS
            {
                continue;
            }
            let key = report::uuid_key(&s.last.device_uuid);
            let by_uuid = report
                .devices
                .iter()
                .find(|d| d.uuid_key.as_deref() == Some(key.as_str()));
            let only_one = (report.devices.len() == 1
                && report.devices[0].uuid_key.is_none()
                && devices_per_pid.get(&s.last.pid) == Some(&1))
            .then(|| &report.devices[0]);
            // A report on the socket wins over what the source knew.
            if let Some(d) = by_uuid.or(only_one) {
                s.last.allocator = Some(d.stats);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::source::{ProcessOwner, ProcessReading};

    fn sample(pid: u32, device: &str) -> ProcessSample {
        ProcessSample {
            timestamp_ms: 1,
            last: ProcessReading {
                device_uuid: device.into(),
                pid,
                start_time_ms: 1,
                memory_used: 100,
                owner: Arc::new(ProcessOwner::default()),
                allocator: None,
            },
            memory_used_max: 100,
        }
    }

    fn device(uuid: Option<&str>, reserved: u64) -> DeviceReport {
        DeviceReport {
            index: 0,
            uuid_key: uuid.map(report::uuid_key),
            stats: AllocatorStats {
                reserved_bytes: reserved,
                ..AllocatorStats::default()
            },
        }
    }

    fn sender(pid: u32, connection: u64) -> Sender {
        Sender {
            pid,
            start_time_ms: Some(1),
            connection,
        }
    }

    #[test]
    fn a_reused_pid_does_not_inherit_the_report() {
        let reports = AllocatorReports::default();
        reports.record(sender(7, 1), vec![device(Some("aa"), 10)]);
        let mut same = vec![sample(7, "GPU-aa")];
        reports.attach(&mut same);
        assert!(same[0].last.allocator.is_some());
        let mut reused = vec![sample(7, "GPU-aa")];
        reused[0].last.start_time_ms = 1 + 60_000;
        reports.attach(&mut reused);
        assert_eq!(reused[0].last.allocator, None);
    }

    #[test]
    fn joins_by_uuid_whatever_the_prefix() {
        let reports = AllocatorReports::default();
        reports.record(
            sender(7, 1),
            vec![device(Some("aa"), 10), device(Some("MIG-BB"), 20)],
        );
        let mut samples = vec![
            sample(7, "GPU-aa"),
            sample(7, "MIG-bb"),
            sample(8, "GPU-aa"),
        ];
        reports.attach(&mut samples);
        assert_eq!(samples[0].last.allocator.unwrap().reserved_bytes, 10);
        assert_eq!(samples[1].last.allocator.unwrap().reserved_bytes, 20);
        assert_eq!(samples[2].last.allocator, None, "another process");
    }

    #[test]
    fn a_report_without_uuid_joins_only_where_it_is_unambiguous() {
        let reports = AllocatorReports::default();
        reports.record(sender(7, 1), vec![device(None, 10)]);
        let mut one = vec![sample(7, "GPU-aa")];
        reports.attach(&mut one);
        assert_eq!(one[0].last.allocator.unwrap().reserved_bytes, 10);
        let mut two = vec![sample(7, "GPU-aa"), sample(7, "GPU-bb")];
        reports.attach(&mut two);
        assert!(two.iter().all(|s| s.last.allocator.is_none()));
    }

    #[test]
    fn stale_and_withdrawn_reports_are_not_joined() {
        let reports = AllocatorReports::new(Duration::ZERO);
        reports.record(sender(7, 1), vec![device(Some("aa"), 10)]);
        std::thread::sleep(Duration::from_millis(2));
        let mut samples = vec![sample(7, "GPU-aa")];
        reports.attach(&mut samples);
        assert_eq!(samples[0].last.allocator, None);
        assert!(reports.is_empty(), "stale reports are dropped");

        let reports = AllocatorReports::default();
        reports.record(sender(7, 2), vec![device(Some("aa"), 10)]);
        reports.forget(7, 1);
        assert_eq!(reports.len(), 1, "an older connection cannot withdraw it");
        reports.forget(7, 2);
        assert!(reports.is_empty());
    }
}
