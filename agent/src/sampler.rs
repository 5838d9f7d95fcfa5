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
            while !stop.load(Ordering::Relaxed) {
                let mut flush_now = false;
                let poll_started = Instant::now();
                match source.poll() {
                    Ok(poll) => {
                        let poll = Arc::new(poll);
                        metrics.record_poll(&poll, poll_started.elapsed());
                        window.observe(&poll);
                        flush_now = crossings.crossed(&poll);
                    }
                    Err(error) => {
                        metrics.record_poll_failure();
                        failed_polls += 1;
                        tracing::warn!(%error, failed_polls, "GPU poll failed");
                    }
                }
                next_poll += timing.poll_interval;
                let now = Instant::now();
                if flush_now && now < interval_end {
                    // A short interval now; the regular schedule carries on.
                    let samples =
                        close_interval(&mut window, &allocator_reports, interval_start, now);
                    interval_start = now;
                    if intervals.blocking_send(samples).is_err() {
                        break;
                    }
                } else if now >= interval_end {
                    let samples =
                        close_interval(&mut window, &allocator_reports, interval_start, now);
                    interval_start = now;
                    interval_end += timing.sample_interval;
                    // After a long stall, realign instead of emitting a burst
                    // of empty intervals.
                    if interval_end < now {
                        interval_end = now + timing.sample_interval;
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
) -> IntervalSamples {
    let elapsed = u32::try_from(now.duration_since(start).as_millis())
        .unwrap_or(u32::MAX)
        .max(1);
    let mut samples = window.finish(epoch_ms_now(), elapsed);
    allocator_reports.attach(&mut samples.processes);
    samples
}
