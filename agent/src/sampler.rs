//! The polling loop. It owns the `GpuSource` on a thread of its own, because
//! source calls block (NVML can block for seconds), and hands each finished
//! interval to the uplink through a bounded channel.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::allocator::AllocatorReports;
use crate::flush::CrossingDetector;
use crate::metrics::AgentMetrics;
use crate::source::GpuSource;
use crate::time::epoch_ms_now;
use crate::window::{IntervalSamples, SampleWindow};

#[derive(Debug, Clone, Copy)]
pub struct SamplerTiming {
    pub poll_interval: Duration,
    pub sample_interval: Duration,
    /// Ship at once when a device crosses this fraction of its memory.
    pub flush_above: f64,
}

/// Runs until `stop` is set or the uplink goes away.
pub fn spawn(
    mut source: Box<dyn GpuSource>,
    timing: SamplerTiming,
    intervals: mpsc::Sender<IntervalSamples>,
    metrics: Arc<AgentMetrics>,
    allocator_reports: Arc<AllocatorReports>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("headroom-sampler".into())
        .spawn(move || {
            let mut window = SampleWindow::new();
            let mut crossings = CrossingDetector::new(timing.flush_above);
            let mut next_poll = Instant::now();
            let mut interval_start = next_poll;
            let mut interval_end = next_poll + timing.sample_interval;
            let mut failed_polls: u64 = 0;
            // A crossing waits here when its poll fell in the millisecond the
            // previous interval ended in: ending another interval there would
            // give the device two samples at one time.
            let mut flush_pending = false;
            let mut last_end_ms = i64::MIN;
            while !stop.load(Ordering::Relaxed) {
                let poll_started = Instant::now();
                match source.poll() {
                    Ok(poll) => {
                        let poll = Arc::new(poll);
                        metrics.record_poll(&poll, poll_started.elapsed());
                        window.observe(&poll);
                        flush_pending |= crossings.crossed(&poll);
                    }
                    Err(error) => {
                        metrics.record_poll_failure();
                        failed_polls += 1;
                        tracing::warn!(%error, failed_polls, "GPU poll failed");
                    }
                }
                next_poll += timing.poll_interval;
                let now = Instant::now();
                let end_ms = epoch_ms_now();
                let due = now >= interval_end;
                if (flush_pending || due) && end_ms != last_end_ms {
                    let samples = close_interval(
                        &mut window,
                        &allocator_reports,
                        interval_start,
                        now,
                        end_ms,
                    );
                    interval_start = now;
                    last_end_ms = end_ms;
                    flush_pending = false;
                    // An early flush is a short interval; the regular
                    // schedule carries on.
                    if due {
                        interval_end += timing.sample_interval;
                        // After a long stall, realign instead of emitting a
                        // burst of empty intervals.
                        if interval_end < now {
                            interval_end = now + timing.sample_interval;
                        }
                    }
                    if intervals.blocking_send(samples).is_err() {
                        break;
                    }
                }
                let now = Instant::now();
                if next_poll > now {
                    std::thread::sleep(next_poll - now);
                } else {
                    next_poll = now;
                }
            }
            tracing::debug!("sampler stopped");
        })
}

/// Ends the interval that began at `start`: its samples, with the allocator
/// reports of the processes in it joined.
fn close_interval(
    window: &mut SampleWindow,
    allocator_reports: &AllocatorReports,
    start: Instant,
    now: Instant,
    end_ms: i64,
) -> IntervalSamples {
    let elapsed = u32::try_from(now.duration_since(start).as_millis())
        .unwrap_or(u32::MAX)
        .max(1);
    let mut samples = window.finish(end_ms, elapsed);
    allocator_reports.attach(&mut samples.processes);
    samples
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{DeviceReading, Inventory, Poll, SourceError};

    /// One GPU whose memory swings across the flush threshold on every
    /// poll: a crossing, so an early flush, every other poll.
    #[derive(Debug, Default)]
    struct Swinging {
        polls: u64,
    }

    impl GpuSource for Swinging {
        fn inventory(&mut self) -> Result<Inventory, SourceError> {
            Ok(empty_inventory())
        }

        fn poll(&mut self) -> Result<Poll, SourceError> {
            self.polls += 1;
            let used = if self.polls.is_multiple_of(2) { 95 } else { 50 };
            Ok(Poll {
                devices: vec![DeviceReading {
                    uuid: "GPU-0".into(),
                    memory_used: used,
                    memory_reserved: 0,
                    memory_total: 100,
                    utilization_pct: None,
                    pcie_tx_bytes_per_s: None,
                    pcie_rx_bytes_per_s: None,
                    health: None,
                }],
                ..Poll::default()
            })
        }
    }

    fn empty_inventory() -> Inventory {
        Inventory {
            driver_version: String::new(),
            gpus: Vec::new(),
        }
    }

    #[test]
    fn no_two_intervals_of_a_device_end_at_the_same_millisecond() {
        // Polls back to back, every one due to end an interval and every
        // other one a crossing: many polls share a millisecond, as they do
        // when a starved agent catches up.
        let (tx, mut rx) = mpsc::channel(64);
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = spawn(
            Box::new(Swinging::default()),
            SamplerTiming {
                poll_interval: Duration::ZERO,
                sample_interval: Duration::ZERO,
                flush_above: 0.9,
            },
            tx,
            AgentMetrics::new("n1", &empty_inventory()),
            Arc::new(AllocatorReports::default()),
            stop.clone(),
        )
        .unwrap();
        let mut ends = Vec::new();
        while ends.len() < 200 {
            let interval = rx.blocking_recv().unwrap();
            ends.extend(interval.gpus.iter().map(|g| g.timestamp_ms));
        }
        stop.store(true, Ordering::Relaxed);
        drop(rx);
        sampler.join().unwrap();
        let repeats: Vec<&[i64]> = ends.windows(2).filter(|w| w[0] >= w[1]).collect();
        assert!(
            repeats.is_empty(),
            "{} of {} interval ends do not increase, first {:?}",
            repeats.len(),
            ends.len(),
            repeats.first()
        );
    }
}
