//! Streams intervals to the collector over gRPC and keeps every batch until
//! the collector acknowledges that it committed it.
//!
//! Sequence numbers are assigned when a batch first goes on the wire, after a
//! `Register` told us what the collector already holds for this boot; a batch
//! keeps its number through reconnects, so a replay is recognised and stored
//! once. Batches wait in a bounded in-memory queue while the collector is
//! away; past the bound the oldest are dropped and counted.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_client::IngestClient;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

use crate::backoff::Backoff;
use crate::metrics::AgentMetrics;
use crate::source::{EventKind, Inventory, SourceEvent};
use crate::window::IntervalSamples;

#[derive(Debug, Clone)]
pub struct UplinkConfig {
    pub collector_url: String,
    pub node: String,
    pub boot_id: String,
    pub sample_interval_ms: u32,
    pub max_pending_batches: usize,
    pub max_in_flight: usize,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("invalid collector URL {url:?}: {source}")]
    Url {
        url: String,
        source: tonic::transport::Error,
    },
    #[error("cannot connect to the collector: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("collector refused: {0}")]
    Status(#[from] tonic::Status),
    #[error("the collector closed the stream")]
    Closed,
}

enum SessionEnd {
    Shutdown,
    Drained,
    /// The inventory changed: register it before sending anything newer.
    Reregister,
}

#[derive(Debug)]
pub struct Uplink {
    config: UplinkConfig,
    inventory: Inventory,
    /// Oldest first. Batches with `seq == 0` have not been on the wire yet.
    pending: VecDeque<pb::Batch>,
    next_seq: u64,
    dropped_batches: u64,
    input_open: bool,
    /// Set when an interval brought a new inventory the collector has not
    /// been told about yet.
    reregister: bool,
    metrics: Arc<AgentMetrics>,
}

impl Uplink {
    pub fn new(config: UplinkConfig, inventory: Inventory, metrics: Arc<AgentMetrics>) -> Self {
        Self {
            config,
            inventory,
            pending: VecDeque::new(),
            next_seq: 1,
            dropped_batches: 0,
            input_open: true,
            reregister: false,
            metrics,
        }
    }

    /// Runs until `shutdown` flips to true, or until the sampler has stopped
    /// and every batch it produced is acknowledged.
    pub async fn run(
        mut self,
        mut intervals: mpsc::Receiver<IntervalSamples>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut backoff = Backoff::new(self.config.backoff_initial, self.config.backoff_max);
        loop {
            if *shutdown.borrow() {
                return;
            }
            let error = match self
                .session(&mut intervals, &mut shutdown, &mut backoff)
                .await
            {
                Ok(SessionEnd::Shutdown | SessionEnd::Drained) => return,
                Ok(SessionEnd::Reregister) => continue,
                Err(error) => error,
            };
            // The collector processes a stream in order, so the batch it
            // rejected is the oldest one it has not acknowledged. Resending it
            // would fail forever.
            if let SessionError::Status(status) = &error
                && status.code() == Code::InvalidArgument
                && let Some(bad) = self.pending.pop_front()
            {
                self.dropped_batches += 1;
                tracing::error!(
                    seq = bad.seq,
                    reason = status.message(),
                    dropped_batches = self.dropped_batches,
                    "collector rejected a batch; dropping it"
                );
            }
            let delay = backoff.next_delay();
            tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, pending = self.pending.len(), "uplink down");
            // Keep draining the sampler while waiting, so its polling never stalls.
            let sleep = tokio::time::sleep(delay);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break,
                    changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return },
                    interval = intervals.recv(), if self.input_open => self.accept(interval),
                }
            }
        }
    }

    fn accept(&mut self, interval: Option<IntervalSamples>) {
        let Some(mut interval) = interval else {
            self.input_open = false;
            return;
        };
        if let Some(inventory) = interval.inventory.take() {
            tracing::info!(
                gpus = inventory.gpus.len(),
                "inventory changed; registering it again"
            );
            self.inventory = inventory;
            self.reregister = true;
        }
        if self.pending.len() >= self.config.max_pending_batches {
            self.pending.pop_front();
            self.dropped_batches += 1;
            tracing::warn!(
                dropped_batches = self.dropped_batches,
                "pending queue full; dropped the oldest batch"
            );
        }
        self.pending
            .push_back(to_batch(&self.config.node, &self.config.boot_id, interval));
        self.report_queue();
    }

    async fn session(
        &mut self,
        intervals: &mut mpsc::Receiver<IntervalSamples>,
        shutdown: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
    ) -> Result<SessionEnd, SessionError> {
        let endpoint = Endpoint::from_shared(self.config.collector_url.clone())
            .map_err(|source| SessionError::Url {
                url: self.config.collector_url.clone(),
                source,
            })?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        let channel: Channel = endpoint.connect().await?;
        let mut client = IngestClient::new(channel);
        let committed = client
            .register(to_register(&self.config, &self.inventory))
            .await?
            .into_inner()
            .committed_seq;
        self.reregister = false;
        self.forget_committed(committed);
        self.next_seq = self.next_seq.max(committed + 1);
        backoff.reset();
        tracing::info!(collector = %self.config.collector_url, committed_seq = committed, replaying = self.pending.len(), "connected to collector");

        let (outbound, outbound_rx) = mpsc::channel(self.config.max_in_flight.max(1));
        let mut acks = client
            .stream(ReceiverStream::new(outbound_rx))
            .await?
            .into_inner();
        let mut in_flight = 0usize;
        loop {
            while in_flight < self.pending.len() && in_flight < self.config.max_in_flight {
                let batch = &mut self.pending[in_flight];
                if batch.seq == 0 {
                    batch.seq = self.next_seq;
                    self.next_seq += 1;
                }
                match outbound.try_send(batch.clone()) {
                    Ok(()) => in_flight += 1,
                    Err(mpsc::error::TrySendError::Full(_)) => break,
                    Err(mpsc::error::TrySendError::Closed(_)) => return Err(SessionError::Closed),
                }
            }
            if !self.input_open && self.pending.is_empty() {
                return Ok(SessionEnd::Drained);
            }
            tokio::select! {
                changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return Ok(SessionEnd::Shutdown) },
                ack = acks.message() => match ack? {
                    Some(ack) => in_flight -= self.forget_committed(ack.committed_seq).min(in_flight),
                    None => return Err(SessionError::Closed),
                },
                interval = intervals.recv(), if self.input_open => {
                    let was_full = self.pending.len() >= self.config.max_pending_batches;
                    self.accept(interval);
                    if was_full && in_flight > 0 {
                        in_flight -= 1;
                    }
                    // Batches already sent are replayed after the new
                    // registration and stored once by their seq.
                    if self.reregister {
                        return Ok(SessionEnd::Reregister);
                    }
                }
            }
        }
    }

    fn report_queue(&self) {
        self.metrics
            .set_queue(self.pending.len(), self.dropped_batches);
    }

    /// Drops batches the collector holds; returns how many.
    fn forget_committed(&mut self, committed: u64) -> usize {
        let mut forgotten = 0;
        while self
            .pending
            .front()
            .is_some_and(|b| b.seq != 0 && b.seq <= committed)
        {
            self.pending.pop_front();
            forgotten += 1;
        }
        self.report_queue();
        forgotten
    }
}

fn to_register(config: &UplinkConfig, inventory: &Inventory) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node: config.node.clone(),
        boot_id: config.boot_id.clone(),
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        driver_version: inventory.driver_version.clone(),
        sample_interval_ms: config.sample_interval_ms,
        gpus: inventory
            .gpus
            .iter()
            .map(|g| pb::Gpu {
                uuid: g.uuid.clone(),
                index: g.index,
                name: g.name.clone(),
                memory_total_bytes: g.memory_total,
                pcie_generation: g.pcie_generation,
                pcie_width: g.pcie_width,
                mig_instances: g
                    .mig_instances
                    .iter()
                    .map(|m| pb::MigInstance {
                        uuid: m.uuid.clone(),
                        gpu_instance_id: m.gpu_instance_id,
                        compute_instance_id: m.compute_instance_id,
                        profile: m.profile.clone(),
                        memory_total_bytes: m.memory_total,
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn to_batch(node: &str, boot_id: &str, interval: IntervalSamples) -> pb::Batch {
    pb::Batch {
        node: node.to_owned(),
        boot_id: boot_id.to_owned(),
        seq: 0,
        gpu_samples: interval
            .gpus
            .into_iter()
            .map(|g| pb::GpuSample {
                uuid: g.uuid,
                timestamp_ms: g.timestamp_ms,
                interval_ms: g.interval_ms,
                poll_count: g.poll_count,
                memory_used_last_bytes: g.memory_used_last,
                memory_used_min_bytes: g.memory_used_min,
                memory_used_max_bytes: g.memory_used_max,
                memory_reserved_bytes: g.memory_reserved,
                memory_total_bytes: g.memory_total,
                utilization_pct: g.utilization_pct,
                pcie_tx_bytes_per_s: g.pcie_tx_bytes_per_s,
                pcie_rx_bytes_per_s: g.pcie_rx_bytes_per_s,
            })
            .collect(),
        process_samples: interval
            .processes
            .into_iter()
            .map(|p| pb::ProcessSample {
                uuid: p.last.device_uuid.to_string(),
                timestamp_ms: p.timestamp_ms,
                pid: p.last.pid,
                start_time_ms: p.last.start_time_ms,
                memory_used_last_bytes: p.last.memory_used,
                memory_used_max_bytes: p.memory_used_max,
                name: p.last.owner.name.clone(),
                uid: p.last.owner.uid,
                user: p.last.owner.user.clone(),
                container_id: p.last.owner.container_id.clone(),
                pod_uid: p.last.owner.pod_uid.clone(),
                slurm_job_id: p.last.owner.slurm_job_id.clone(),
                container_runtime: p.last.owner.container_runtime.clone(),
                pod_qos_class: p.last.owner.pod_qos_class.clone(),
                allocator: p.last.allocator.map(|a| pb::AllocatorStats {
                    timestamp_ms: a.timestamp_ms,
                    allocated_bytes: a.allocated_bytes,
                    reserved_bytes: a.reserved_bytes,
                    active_bytes: a.active_bytes,
                    inactive_split_bytes: a.inactive_split_bytes,
                    peak_allocated_bytes: a.peak_allocated_bytes,
                    alloc_retries: a.alloc_retries,
                    ooms: a.ooms,
                }),
            })
            .collect(),
        events: interval.events.into_iter().map(to_event).collect(),
    }
}

fn to_event(e: SourceEvent) -> pb::Event {
    let kind = match e.kind {
        EventKind::Xid => pb::EventKind::Xid,
        EventKind::GpuLost => pb::EventKind::GpuLost,
        EventKind::MigReconfigured => pb::EventKind::MigReconfigured,
        EventKind::NvmlHung => pb::EventKind::NvmlHung,
        EventKind::NvmlInvalidData => pb::EventKind::NvmlInvalidData,
    };
    pb::Event {
        kind: kind.into(),
        timestamp_ms: e.timestamp_ms,
        uuid: e.device_uuid,
        code: e.code,
        pid: e.pid,
        detail: e.detail,
    }
}
