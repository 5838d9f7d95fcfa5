//! `headroom-agent`: the per-node daemon. It polls a [`source::GpuSource`]
//! on its own thread, folds the fast polls into per-interval samples
//! ([`window`]) and streams them to the collector ([`uplink`]).

pub mod allocator;
pub mod attribution;
pub mod backoff;
pub mod batch_split;
pub mod config;
pub mod flush;
pub mod identity;
pub mod kubernetes;
pub mod metrics;
mod metrics_dcgm;
pub mod outbox;
pub mod sampler;
pub mod source;
pub mod time;
pub mod tls;
pub mod uplink;
pub mod window;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::allocator::AllocatorReports;
use crate::allocator::listener::{self, ListenerConfig};
use crate::metrics::AgentMetrics;
use crate::outbox::{MemoryLog, Outbox, OutboxError, RecordLog, Spool, SpoolConfig};
use crate::sampler::SamplerTiming;
use crate::source::{GpuSource, SourceError};
pub use crate::uplink::AgentToken;
use crate::uplink::{Uplink, UplinkConfig};

/// What a running agent needs besides its source.
#[derive(Debug, Clone)]
pub struct AgentSettings {
    pub collector_url: String,
    pub node: String,
    /// Presented to the collector on every call (`[agents] require_token`).
    pub token: Option<AgentToken>,
    /// TLS settings for an `https://` collector URL.
    pub tls: Option<tonic::transport::ClientTlsConfig>,
    /// Where unacknowledged batches wait; `None` keeps them in memory only
    /// (lost with the process).
    pub spool: Option<SpoolConfig>,
    /// The stream id without a spool: it must be new for every run, since
    /// sequence numbers start again at 1. With a spool, the spool keeps it.
    pub boot_id: String,
    pub poll_interval: Duration,
    pub sample_interval: Duration,
    /// Batches kept in memory without a spool; past it the oldest are dropped.
    pub max_pending_batches: usize,
    /// Ship at once when a device crosses this fraction of its memory, so
    /// the collector's watermark rule need not wait for the interval.
    pub flush_above: f64,
    /// Where to serve Prometheus `/metrics` and `/healthz`; `None` for none.
    pub metrics_listen: Option<SocketAddr>,
    /// Also expose memory, PCIe and XID figures under dcgm-exporter's
    /// names, for dashboards and rules written for it.
    pub dcgm_metric_names: bool,
    /// The Unix socket training processes report allocator statistics on;
    /// `None` for none.
    pub allocator_socket: Option<ListenerConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("reading the GPU inventory failed: {0}")]
    Inventory(#[from] SourceError),
    #[error("cannot open the spool: {0}")]
    Spool(#[from] OutboxError),
    #[error("cannot start the sampler thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running agent; [`AgentHandle::stop`] ends it.
#[derive(Debug)]
pub struct AgentHandle {
    stop_sampler: Arc<AtomicBool>,
    shutdown: watch::Sender<bool>,
    sampler: Option<std::thread::JoinHandle<()>>,
    uplink: tokio::task::JoinHandle<()>,
    metrics_server: Option<tokio::task::JoinHandle<()>>,
    metrics_addr: Option<SocketAddr>,
    metrics: Arc<AgentMetrics>,
    allocator_listener: Option<listener::ListenerHandle>,
}

impl AgentHandle {
    /// Where `/metrics` is served (the bound port when configured with port 0).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Reads the turns of the poll loop so far, failed polls included: the
    /// count moves as long as the sampler is alive, whatever the hardware
    /// says (for the systemd watchdog).
    pub fn sampler_progress(&self) -> impl Fn() -> u64 + Send + 'static {
        let metrics = self.metrics.clone();
        move || metrics.sampler_turns()
    }

    /// Stops polling and shipping at once; unacknowledged batches stay in
    /// the spool for the next run (without one, they are lost).
    pub async fn stop(mut self) {
        if let Some(server) = self.metrics_server.take() {
            server.abort();
        }
        if let Some(listener) = self.allocator_listener.take() {
            let _ = tokio::task::spawn_blocking(move || listener.stop()).await;
        }
        self.stop_sampler.store(true, Ordering::Relaxed);
        let _ = self.shutdown.send(true);
        let _ = (&mut self.uplink).await;
        if let Some(sampler) = self.sampler.take() {
            let _ = tokio::task::spawn_blocking(move || sampler.join()).await;
        }
    }

    /// Resolves when the uplink ends on its own (it does not, short of a stop).
    pub async fn wait(&mut self) {
        let _ = (&mut self.uplink).await;
    }
}

/// Starts an agent: reads the inventory, then runs the sampler thread and the
/// uplink task on the current Tokio runtime.
pub fn start(
    settings: AgentSettings,
    mut source: Box<dyn GpuSource>,
) -> Result<AgentHandle, StartError> {
    let inventory = source.inventory()?;
    let log: Box<dyn RecordLog> = match settings.spool.clone() {
        Some(config) => Box::new(Spool::open(config)?),
        None => Box::new(MemoryLog::new(
            settings.boot_id.clone(),
            settings.max_pending_batches,
        )),
    };
    tracing::info!(node = %settings.node, gpus = inventory.gpus.len(), driver = %inventory.driver_version, "inventory read");
    let metrics = AgentMetrics::new(&settings.node, &inventory);
    metrics.set_dcgm_names(settings.dcgm_metric_names);
    let (metrics_addr, metrics_server) = match settings.metrics_listen {
        Some(addr) => {
            let listener = std::net::TcpListener::bind(addr)
                .map_err(|source| StartError::Metrics { addr, source })?;
            let (bound, task) = metrics::serve(metrics.clone(), listener)
                .map_err(|source| StartError::Metrics { addr, source })?;
            tracing::info!(%bound, "serving /metrics");
            (Some(bound), Some(task))
        }
        None => (None, None),
    };
    let allocator_reports = Arc::new(AllocatorReports::new(
        (settings.sample_interval * 3).max(std::time::Duration::from_secs(5)),
    ));
    // Allocator reports add detail; a socket that cannot be opened is
    // logged and shown in /metrics, and GPU monitoring goes on without it.
    let allocator_listener = match settings.allocator_socket.clone() {
        Some(config) => {
            match listener::spawn(config.clone(), allocator_reports.clone(), metrics.clone()) {
                Ok(handle) => {
                    tracing::info!(path = %config.path.display(), "listening for allocator reports");
                    metrics.set_allocator_socket_up(true);
                    Some(handle)
                }
                Err(error) => {
                    tracing::error!(%error, "allocator reports are off");
                    None
                }
            }
        }
        None => None,
    };
    let (intervals_tx, intervals_rx) = mpsc::channel(16);
    let stop_sampler = Arc::new(AtomicBool::new(false));
    let sampler = sampler::spawn(
        source,
        SamplerTiming {
            poll_interval: settings.poll_interval,
            sample_interval: settings.sample_interval,
            flush_above: settings.flush_above,
        },
        intervals_tx,
        metrics.clone(),
        allocator_reports,
        stop_sampler.clone(),
    )?;
    let handle_metrics = metrics.clone();
    let (shutdown, shutdown_rx) = watch::channel(false);
    let uplink = Uplink::new(
        UplinkConfig {
            collector_url: settings.collector_url,
            node: settings.node,
            token: settings.token,
            tls: settings.tls,
            sample_interval_ms: u32::try_from(settings.sample_interval.as_millis())
                .unwrap_or(u32::MAX),
            max_in_flight: 32,
            backoff_initial: Duration::from_millis(250),
            backoff_max: Duration::from_secs(30),
        },
        &inventory,
        Outbox::new(log),
        metrics,
    );
    let uplink = tokio::spawn(uplink.run(intervals_rx, shutdown_rx));
    Ok(AgentHandle {
        stop_sampler,
        shutdown,
        sampler: Some(sampler),
        uplink,
        metrics_server,
        metrics_addr,
        metrics: handle_metrics,
        allocator_listener,
    })
}
