//! The collector's own Prometheus endpoint: what ingest accepted, refused
//! and how long its writes took, storage errors, open agent streams, and
//! the alerts and notifications waiting. Counters live here; alert and
//! outbox figures are read from the store at scrape time, so they are never
//! stale.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::store::alerts::ActiveAlertCounts;

/// Upper bounds (seconds) of the batch-write histogram: a commit on a
/// healthy database takes milliseconds; seconds mean trouble.
const WRITE_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// How a batch ended.
#[derive(Debug, Clone, Copy)]
pub enum BatchOutcome {
    Committed,
    /// A replay of a batch already stored.
    Duplicate,
    /// Refused as invalid (the agent drops it).
    Rejected,
    /// The store failed (the agent retries it).
    Failed,
}

#[derive(Debug, Default)]
pub struct CollectorMetrics {
    registrations: AtomicU64,
    committed: AtomicU64,
    duplicate: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
    gpu_samples: AtomicU64,
    process_samples: AtomicU64,
    events: AtomicU64,
    storage_errors: AtomicU64,
    open_streams: AtomicI64,
    write_buckets: [AtomicU64; WRITE_BUCKETS.len()],
    write_count: AtomicU64,
    write_micros: AtomicU64,
}

/// Figures read from the store when scraped.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreFigures {
    pub alerts: Option<ActiveAlertCounts>,
    pub outbox_undelivered: Option<i64>,
}

impl CollectorMetrics {
    pub fn registered(&self) {
        self.registrations.fetch_add(1, Ordering::Relaxed);
    }

    pub fn batch(&self, outcome: BatchOutcome) {
        let counter = match outcome {
            BatchOutcome::Committed => &self.committed,
            BatchOutcome::Duplicate => &self.duplicate,
            BatchOutcome::Rejected => &self.rejected,
            BatchOutcome::Failed => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Rows of a committed batch.
    pub fn stored(&self, gpu_samples: usize, process_samples: usize, events: usize) {
        let add = |counter: &AtomicU64, n: usize| {
            counter.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
        };
        add(&self.gpu_samples, gpu_samples);
        add(&self.process_samples, process_samples);
        add(&self.events, events);
    }

    pub fn storage_error(&self) {
        self.storage_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// One batch write (validate excluded, commit included).
    pub fn write_took(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        for (bucket, bound) in self.write_buckets.iter().zip(WRITE_BUCKETS) {
            if seconds <= bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.write_count.fetch_add(1, Ordering::Relaxed);
        self.write_micros.fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    pub fn stream_opened(&self) {
        self.open_streams.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_closed(&self) {
        self.open_streams.fetch_sub(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition format, version 0.0.4.
    pub fn render(&self, store: StoreFigures) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::with_capacity(2048);
        family(
            &mut out,
            "headroom_collector_registrations_total",
            "counter",
            "Agent registrations accepted.",
            &[("", get(&self.registrations).to_string())],
        );
        family(
            &mut out,
            "headroom_collector_batches_total",
            "counter",
            "Batches by outcome: committed, duplicate (a replay already stored), rejected (invalid, dropped by the agent), failed (storage error, retried by the agent).",
            &[
                ("outcome=\"committed\"", get(&self.committed).to_string()),
                ("outcome=\"duplicate\"", get(&self.duplicate).to_string()),
                ("outcome=\"rejected\"", get(&self.rejected).to_string()),
                ("outcome=\"failed\"", get(&self.failed).to_string()),
            ],
        );
        family(
            &mut out,
            "headroom_collector_samples_total",
            "counter",
            "Rows stored from committed batches.",
            &[
                ("kind=\"gpu\"", get(&self.gpu_samples).to_string()),
                ("kind=\"process\"", get(&self.process_samples).to_string()),
                ("kind=\"event\"", get(&self.events).to_string()),
            ],
        );
        family(
            &mut out,
            "headroom_collector_storage_errors_total",
            "counter",
            "Database operations that failed during ingest.",
            &[("", get(&self.storage_errors).to_string())],
        );
        family(
            &mut out,
            "headroom_collector_agent_streams",
            "gauge",
            "Agent streams open now.",
            &[("", self.open_streams.load(Ordering::Relaxed).to_string())],
        );
        let _ = writeln!(
            out,
            "# HELP headroom_collector_batch_write_seconds Time to store one batch, commit included."
        );
        let _ = writeln!(
            out,
            "# TYPE headroom_collector_batch_write_seconds histogram"
        );
        for (bucket, bound) in self.write_buckets.iter().zip(WRITE_BUCKETS) {
            let _ = writeln!(
                out,
                "headroom_collector_batch_write_seconds_bucket{{le=\"{bound}\"}} {}",
                get(bucket)
            );
        }
        let count = get(&self.write_count);
        let _ = writeln!(
            out,
            "headroom_collector_batch_write_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            out,
            "headroom_collector_batch_write_seconds_sum {}",
            get(&self.write_micros) as f64 / 1e6
        );
        let _ = writeln!(out, "headroom_collector_batch_write_seconds_count {count}");
        let alerts: Vec<(&str, String)> = store
            .alerts
            .map(|a| {
                vec![
                    ("state=\"pending\"", a.pending.to_string()),
                    ("state=\"firing\"", a.firing.to_string()),
                ]
            })
            .unwrap_or_default();
        family(
            &mut out,
            "headroom_collector_alerts",
            "gauge",
            "Alerts pending (condition true, waiting out `for`) and firing.",
            &alerts,
        );
        let outbox: Vec<(&str, String)> = store
            .outbox_undelivered
            .map(|n| ("", n.to_string()))
            .into_iter()
            .collect();
        family(
            &mut out,
            "headroom_collector_outbox_undelivered",
            "gauge",
            "Notifications not yet delivered to their channel.",
            &outbox,
        );
        out
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str, rows: &[(&str, String)]) {
    headroom_agent::metrics::write_family(out, name, kind, help, rows.iter().cloned());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = CollectorMetrics::default();
        m.write_took(Duration::from_micros(800));
        m.write_took(Duration::from_millis(30));
        let text = m.render(StoreFigures::default());
        assert!(
            text.contains("headroom_collector_batch_write_seconds_bucket{le=\"0.001\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("headroom_collector_batch_write_seconds_bucket{le=\"0.05\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("headroom_collector_batch_write_seconds_bucket{le=\"+Inf\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("headroom_collector_batch_write_seconds_count 2\n"),
            "{text}"
        );
    }
}
