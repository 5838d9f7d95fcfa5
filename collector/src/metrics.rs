//! The collector's own Prometheus endpoint: what ingest accepted, refused
//! and how long its writes took, storage errors, open agent streams, and
//! the alerts and notifications waiting. Counters live here; alert and
//! outbox figures are read from the store at scrape time, so they are never
//! stale.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use headroom_store::alerts::ActiveAlertCounts;
use headroom_store::rollup::MaintenanceReport;

/// Upper bounds (seconds) of the batch-write histogram: a commit on a
/// healthy database takes milliseconds; seconds mean trouble.
const WRITE_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Upper bounds (seconds) of the alert-delay histograms: an alert is a race
/// against an OOM, so the buckets are fine below a second.
const ALERT_DELAY_BUCKETS: &[f64] = &[
    0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A Prometheus histogram of durations, filled from many tasks at once.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Cumulative: each bucket counts every observation at or below its bound.
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            micros: AtomicU64::new(0),
        }
    }

    fn observe(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        for (bucket, bound) in self.buckets.iter().zip(self.bounds) {
            if seconds <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.micros.fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// The `_bucket`, `_sum` and `_count` lines of `name` with `labels`
    /// (`key="value"` pairs, or empty), after its HELP and TYPE when `help` is given.
    fn render(&self, out: &mut String, name: &str, help: Option<&str>, labels: &str) {
        if let Some(help) = help {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} histogram");
        }
        let sep = if labels.is_empty() { "" } else { "," };
        for (bucket, bound) in self.buckets.iter().zip(self.bounds) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let braced = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(
            out,
            "{name}_sum{braced} {}",
            self.micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count{braced} {count}");
    }
}

/// How far an alert's notification had got, timed from the sample that
/// changed the alert.
#[derive(Debug, Clone, Copy)]
pub enum AlertStage {
    /// The alert change and its notifications committed to the outbox:
    /// the agent's send, the wire, ingest and the rules.
    Committed,
    /// The receiver said yes: the outbox queue and the delivery besides.
    Delivered,
}

/// Why the HTTP server turned a client away before any handler ran.
#[derive(Debug, Clone, Copy)]
pub enum HttpRefusal {
    /// `[http] max_connections` were open.
    Connections,
    /// `[http] max_stream_clients` were following the live stream.
    StreamClients,
    /// The request named a host not in `[http] allowed_hosts`.
    Host,
}

/// How a read of another collector's open samples ended.
#[derive(Debug, Clone, Copy)]
pub enum PeerReadOutcome {
    Answered,
    Failed,
    /// Not asked: it failed a moment ago.
    Skipped,
}

/// How a batch ended.
#[derive(Debug, Clone, Copy)]
pub enum BatchOutcome {
    Committed,
    /// A replay of a batch already stored.
    Duplicate,
    /// A replay of a batch accepted before whose samples were not yet
    /// durable: its samples are taken again.
    Replayed,
    /// Refused as invalid (the agent drops it).
    Rejected,
    /// The store failed (the agent retries it).
    Failed,
}

/// The collector's histograms, each with its own buckets.
#[derive(Debug)]
struct Histograms {
    writes: Histogram,
    alerts_committed: Histogram,
    alerts_delivered: Histogram,
}

impl Default for Histograms {
    fn default() -> Self {
        Self {
            writes: Histogram::new(WRITE_BUCKETS),
            alerts_committed: Histogram::new(ALERT_DELAY_BUCKETS),
            alerts_delivered: Histogram::new(ALERT_DELAY_BUCKETS),
        }
    }
}

#[derive(Debug, Default)]
pub struct CollectorMetrics {
    registrations: AtomicU64,
    registrations_refused: AtomicU64,
    committed: AtomicU64,
    duplicate: AtomicU64,
    replayed: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
    gpu_samples: AtomicU64,
    process_samples: AtomicU64,
    events: AtomicU64,
    storage_errors: AtomicU64,
    auth_failures: AtomicU64,
    http_auth_failures: AtomicU64,
    open_streams: AtomicI64,
    http_connections: AtomicI64,
    http_stream_clients: AtomicI64,
    http_stream_reads: AtomicU64,
    http_refused_connections: AtomicU64,
    http_refused_stream_clients: AtomicU64,
    http_refused_host: AtomicU64,
    histograms: Histograms,
    write_groups: AtomicU64,
    write_group_batches: AtomicU64,
    write_group_splits: AtomicU64,
    maintenance_leader: AtomicI64,
    maintenance_passes: AtomicU64,
    maintenance_failures: AtomicU64,
    chunk_flushes: AtomicU64,
    chunk_flush_failures: AtomicU64,
    chunks_written: AtomicU64,
    chunk_samples_written: AtomicU64,
    peer_reads: AtomicU64,
    peer_read_failures: AtomicU64,
    peer_reads_skipped: AtomicU64,
    partitions_created: AtomicU64,
    partitions_dropped: AtomicU64,
    rows_expired: AtomicU64,
    samples_packed: AtomicU64,
    /// Epoch ms; 0 until the first pass.
    minute_watermark_ms: AtomicI64,
    maintenance_at_ms: AtomicI64,
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

    /// A registration refused for claiming another node's device or for
    /// growing its node's devices past the budget.
    pub fn registration_refused(&self) {
        self.registrations_refused.fetch_add(1, Ordering::Relaxed);
    }

    pub fn batch(&self, outcome: BatchOutcome) {
        let counter = match outcome {
            BatchOutcome::Committed => &self.committed,
            BatchOutcome::Duplicate => &self.duplicate,
            BatchOutcome::Replayed => &self.replayed,
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

    /// A gRPC call refused for its token (missing, unknown, revoked, for
    /// another node, or from a peer that failed too often).
    pub fn auth_failure(&self) {
        self.auth_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// An HTTP request refused: no or a bad credential, a viewer trying to
    /// act, a cross-site change, a locked-out address.
    pub fn http_auth_failure(&self) {
        self.http_auth_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// One batch write (validate excluded, commit included).
    pub fn write_took(&self, took: Duration) {
        self.histograms.writes.observe(took);
    }

    /// A notification reached `stage` `delay_ms` after its alert's sample
    /// was taken (agent and collector clocks apart, so a skewed agent
    /// clock shows here too; a negative delay counts as none).
    pub fn alert_reached(&self, stage: AlertStage, delay_ms: i64) {
        let delay = Duration::from_millis(u64::try_from(delay_ms).unwrap_or(0));
        match stage {
            AlertStage::Committed => self.histograms.alerts_committed.observe(delay),
            AlertStage::Delivered => self.histograms.alerts_delivered.observe(delay),
        }
    }

    /// One database write of `batches` coalesced batches.
    pub fn write_group(&self, batches: usize) {
        self.write_groups.fetch_add(1, Ordering::Relaxed);
        self.write_group_batches.fetch_add(
            u64::try_from(batches).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// A write of several batches failed and was redone batch by batch.
    pub fn write_group_split(&self) {
        self.write_group_splits.fetch_add(1, Ordering::Relaxed);
    }

    pub fn maintenance(&self, report: &MaintenanceReport, now_ms: i64) {
        let add = |counter: &AtomicU64, n: u64| {
            counter.fetch_add(n, Ordering::Relaxed);
        };
        add(&self.maintenance_passes, 1);
        add(&self.partitions_created, report.partitions_created);
        add(&self.partitions_dropped, report.partitions_dropped);
        add(&self.rows_expired, report.rows_expired);
        add(&self.samples_packed, report.samples_packed);
        self.maintenance_leader
            .store(i64::from(report.leader), Ordering::Relaxed);
        if let Some(marks) = report.watermarks {
            self.minute_watermark_ms
                .store(marks.minute_ms, Ordering::Relaxed);
        }
        self.maintenance_at_ms.store(now_ms, Ordering::Relaxed);
    }

    /// A flush of open chunks that wrote something.
    pub fn chunks_flushed(&self, report: &headroom_store::model::FlushReport) {
        self.chunk_flushes.fetch_add(1, Ordering::Relaxed);
        self.chunks_written
            .fetch_add(report.chunks as u64, Ordering::Relaxed);
        self.chunk_samples_written
            .fetch_add(report.samples as u64, Ordering::Relaxed);
    }

    pub fn chunk_flush_failed(&self) {
        self.chunk_flush_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// How a chart's read of another collector's open samples ended.
    pub fn peer_read(&self, outcome: PeerReadOutcome) {
        let counter = match outcome {
            PeerReadOutcome::Answered => &self.peer_reads,
            PeerReadOutcome::Failed => &self.peer_read_failures,
            PeerReadOutcome::Skipped => &self.peer_reads_skipped,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn maintenance_failed(&self) {
        self.maintenance_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_opened(&self) {
        self.open_streams.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_closed(&self) {
        self.open_streams.fetch_sub(1, Ordering::Relaxed);
    }

    /// An HTTP connection accepted (`true`) or closed (`false`).
    pub fn http_connection(&self, open: bool) {
        self.http_connections
            .fetch_add(if open { 1 } else { -1 }, Ordering::Relaxed);
    }

    /// A live-stream client joined (`true`) or left (`false`).
    pub fn http_stream_client(&self, open: bool) {
        self.http_stream_clients
            .fetch_add(if open { 1 } else { -1 }, Ordering::Relaxed);
    }

    /// The live stream read the fleet from the store (once a period,
    /// however many clients follow it).
    pub fn http_stream_read(&self) {
        self.http_stream_reads.fetch_add(1, Ordering::Relaxed);
    }

    pub fn http_refused(&self, why: HttpRefusal) {
        let counter = match why {
            HttpRefusal::Connections => &self.http_refused_connections,
            HttpRefusal::StreamClients => &self.http_refused_stream_clients,
            HttpRefusal::Host => &self.http_refused_host,
        };
        counter.fetch_add(1, Ordering::Relaxed);
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
            "headroom_collector_registrations_refused_total",
            "counter",
            "Agent registrations refused: a device another node lists, or more devices than the node's budget.",
            &[("", get(&self.registrations_refused).to_string())],
        );
        family(
            &mut out,
            "headroom_collector_batches_total",
            "counter",
            "Batches by outcome: committed, duplicate (a replay already stored), replayed (accepted before, its samples taken again: they were still in open chunks), rejected (invalid, dropped by the agent), failed (storage error, retried by the agent).",
            &[
                ("outcome=\"committed\"", get(&self.committed).to_string()),
                ("outcome=\"duplicate\"", get(&self.duplicate).to_string()),
                ("outcome=\"replayed\"", get(&self.replayed).to_string()),
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
            "headroom_collector_agent_auth_failures_total",
            "counter",
            "Agent gRPC calls refused for their token: missing, unknown, revoked, for another node, or from a peer locked out after repeated failures.",
            &[("", get(&self.auth_failures).to_string())],
        );
        family(
            &mut out,
            "headroom_collector_http_auth_failures_total",
            "counter",
            "Dashboard and API requests refused: no or a bad credential, a viewer trying to act, a cross-site change, or an address locked out after repeated failures.",
            &[("", get(&self.http_auth_failures).to_string())],
        );
        family(
            &mut out,
            "headroom_collector_agent_streams",
            "gauge",
            "Agent streams open now.",
            &[("", self.open_streams.load(Ordering::Relaxed).to_string())],
        );
        self.render_http(&mut out);
        self.histograms.writes.render(
            &mut out,
            "headroom_collector_batch_write_seconds",
            Some("Time from handing one batch to the writers to its commit, queueing included."),
            "",
        );
        self.histograms.alerts_committed.render(
            &mut out,
            "headroom_collector_alert_delay_seconds",
            Some("Time from the sample that fired or resolved an alert to its notification: stage=\"committed\" in the outbox (agent send, wire, ingest, rules), stage=\"delivered\" when the receiver said yes."),
            "stage=\"committed\"",
        );
        self.histograms.alerts_delivered.render(
            &mut out,
            "headroom_collector_alert_delay_seconds",
            None,
            "stage=\"delivered\"",
        );
        family(
            &mut out,
            "headroom_collector_write_groups_total",
            "counter",
            "Database writes of coalesced batches; batches_total / groups_total is the mean batches per write.",
            &[("", get(&self.write_groups).to_string())],
        );
        family(
            &mut out,
            "headroom_collector_write_group_batches_total",
            "counter",
            "Batches carried by coalesced writes.",
            &[("", get(&self.write_group_batches).to_string())],
        );
        family(
            &mut out,
            "headroom_collector_write_group_splits_total",
            "counter",
            "Coalesced writes that failed and were redone batch by batch.",
            &[("", get(&self.write_group_splits).to_string())],
        );
        self.render_maintenance(&mut out);
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

impl CollectorMetrics {
    fn render_http(&self, out: &mut String) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed).to_string();
        family(
            out,
            "headroom_collector_http_connections",
            "gauge",
            "HTTP connections open now (at most [http] max_connections).",
            &[(
                "",
                self.http_connections.load(Ordering::Relaxed).to_string(),
            )],
        );
        family(
            out,
            "headroom_collector_http_stream_clients",
            "gauge",
            "Clients following the live stream /api/v1/stream now (at most [http] max_stream_clients).",
            &[(
                "",
                self.http_stream_clients.load(Ordering::Relaxed).to_string(),
            )],
        );
        family(
            out,
            "headroom_collector_http_stream_fleet_reads_total",
            "counter",
            "Fleet reads from the store for the live stream and the overview API: one a second at most, shared by all their clients.",
            &[("", get(&self.http_stream_reads))],
        );
        family(
            out,
            "headroom_collector_http_refused_total",
            "counter",
            "HTTP clients turned away before any handler ran: too many connections, too many live-stream clients, or a Host not in [http] allowed_hosts.",
            &[
                (
                    "reason=\"connections\"",
                    get(&self.http_refused_connections),
                ),
                (
                    "reason=\"stream_clients\"",
                    get(&self.http_refused_stream_clients),
                ),
                ("reason=\"host\"", get(&self.http_refused_host)),
            ],
        );
    }

    fn render_maintenance(&self, out: &mut String) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed).to_string();
        family(
            out,
            "headroom_collector_chunk_flushes_total",
            "counter",
            "Flushes of open chunks that wrote samples, by result; a failed one is retried, the agents holding its batches meanwhile.",
            &[
                ("result=\"ok\"", get(&self.chunk_flushes)),
                ("result=\"failed\"", get(&self.chunk_flush_failures)),
            ],
        );
        family(
            out,
            "headroom_collector_peer_reads_total",
            "counter",
            "Charts' reads of the samples another collector holds open, by result; skipped: that collector failed within the last few seconds.",
            &[
                ("result=\"ok\"", get(&self.peer_reads)),
                ("result=\"failed\"", get(&self.peer_read_failures)),
                ("result=\"skipped\"", get(&self.peer_reads_skipped)),
            ],
        );
        family(
            out,
            "headroom_collector_chunks_written_total",
            "counter",
            "Compressed chunks written (one per series and hour a flush holds samples of).",
            &[("", get(&self.chunks_written))],
        );
        family(
            out,
            "headroom_collector_chunk_samples_written_total",
            "counter",
            "GPU samples, process samples and allocator reports written in chunks.",
            &[("", get(&self.chunk_samples_written))],
        );
        let passes = self.maintenance_passes.load(Ordering::Relaxed);
        family(
            out,
            "headroom_collector_maintenance_passes_total",
            "counter",
            "Storage maintenance passes, by result.",
            &[
                ("result=\"ok\"", passes.to_string()),
                ("result=\"failed\"", get(&self.maintenance_failures)),
            ],
        );
        if passes == 0 {
            return;
        }
        family(
            out,
            "headroom_collector_maintenance_leader",
            "gauge",
            "1 while this collector runs partitions, rollups and retention for its database (one collector per database does).",
            &[(
                "",
                self.maintenance_leader.load(Ordering::Relaxed).to_string(),
            )],
        );
        let lag_s = (self.maintenance_at_ms.load(Ordering::Relaxed)
            - self.minute_watermark_ms.load(Ordering::Relaxed)) as f64
            / 1000.0;
        family(
            out,
            "headroom_collector_rollup_lag_seconds",
            "gauge",
            "How far the 1 min rollup trails the clock at the last pass (about 2-3 min when healthy).",
            &[("", lag_s.to_string())],
        );
        family(
            out,
            "headroom_collector_partitions_total",
            "counter",
            "Partitions created ahead of time and dropped past retention by this collector.",
            &[
                ("action=\"created\"", get(&self.partitions_created)),
                ("action=\"dropped\"", get(&self.partitions_dropped)),
            ],
        );
        family(
            out,
            "headroom_collector_rows_expired_total",
            "counter",
            "Rows deleted past retention where a table has no partitions (SQLite; the fleet rollups on Postgres).",
            &[("", get(&self.rows_expired))],
        );
        family(
            out,
            "headroom_collector_samples_packed_total",
            "counter",
            "Raw GPU and process samples of cold days moved into compressed chunks by this collector (Postgres).",
            &[("", get(&self.samples_packed))],
        );
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str, rows: &[(&str, String)]) {
    headroom_common::exposition::write_family(out, name, kind, help, rows.iter().cloned());
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
