//! Streams intervals to the collector over gRPC and keeps every batch until
//! the collector acknowledges that it made it durable.
//!
//! Every interval goes into the [`Outbox`] first (in memory, or the disk
//! spool), where it gets its stream id and sequence number; a session sends
//! what the outbox holds in order. Each ack carries two marks: batches up to
//! the accepted one stop counting against `max_in_flight`, batches up to the
//! committed one are forgotten. A batch keeps its number through reconnects
//! and restarts, so a replay is recognised and stored once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_client::IngestClient;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use crate::backoff::Backoff;
use crate::batch_split;
use crate::metrics::AgentMetrics;
use crate::outbox::{Outbox, OutboxError, Record};
use crate::source::{EventKind, Inventory, SourceEvent};
use crate::window::IntervalSamples;

type Client = IngestClient<InterceptedService<Channel, Bearer>>;

/// HTTP/2 pings on the collector connection, and how long one may go
/// unanswered before the connection counts as dead.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone)]
pub struct UplinkConfig {
    pub collector_url: String,
    pub node: String,
    /// Sent as `authorization: Bearer <token>` on every call.
    pub token: Option<AgentToken>,
    /// For an `https://` collector URL.
    pub tls: Option<ClientTlsConfig>,
    pub sample_interval_ms: u32,
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
    /// The batch stream ended with this status: the collector's verdict on
    /// the oldest batch it had not acknowledged.
    #[error("collector ended the stream: {0}")]
    Stream(tonic::Status),
    #[error("the collector closed the stream")]
    Closed,
    #[error(transparent)]
    Outbox(#[from] OutboxError),
}

/// An agent token, checked to be sendable as gRPC metadata; never printed.
#[derive(Clone)]
pub struct AgentToken(MetadataValue<Ascii>);

impl AgentToken {
    pub fn new(token: &str) -> Result<Self, String> {
        let token = token.trim();
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the agent token must be non-empty printable ASCII".into());
        }
        MetadataValue::try_from(format!("Bearer {token}"))
            .map(Self)
            .map_err(|e| format!("the agent token cannot be sent: {e}"))
    }
}

impl std::fmt::Debug for AgentToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AgentToken(…)")
    }
}

/// Puts the token on every request.
#[derive(Debug, Clone)]
struct Bearer(Option<AgentToken>);

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(AgentToken(value)) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

enum SessionEnd {
    Shutdown,
    Drained,
}

#[derive(Debug)]
pub struct Uplink {
    config: UplinkConfig,
    outbox: Outbox,
    input_open: bool,
    metrics: Arc<AgentMetrics>,
    /// The GPU each MIG instance of the current inventory lives in, so a
    /// batch cut in parts keeps an instance with its GPU.
    parent_of: HashMap<String, String>,
}

impl Uplink {
    /// Queues the node's registration ahead of its first batch.
    pub fn new(
        config: UplinkConfig,
        inventory: &Inventory,
        outbox: Outbox,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        let mut uplink = Self {
            config,
            outbox,
            input_open: true,
            metrics,
            parent_of: HashMap::new(),
        };
        uplink.queue_registration(inventory);
        uplink
    }

    fn queue_registration(&mut self, inventory: &Inventory) {
        self.parent_of = inventory
            .gpus
            .iter()
            .flat_map(|g| {
                g.mig_instances
                    .iter()
                    .map(|m| (m.uuid.clone(), g.uuid.clone()))
            })
            .collect();
        let registration = to_register(&self.config, inventory);
        if let Err(error) = self.outbox.push_register(registration) {
            tracing::error!(%error, "cannot queue the registration");
        }
        self.report_queue();
    }

    /// Runs until `shutdown` flips to true, or until the sampler has stopped
    /// and every batch it produced is durable at the collector.
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
                Err(error) => error,
            };
            // The collector processes a stream in order, so the batch it
            // rejected is the oldest one it has not accepted. Resending it
            // would fail forever: refused as invalid, or too big for the
            // collector to read. A refused registration drops nothing: the
            // batches wait until the operator fixes the limit or inventory.
            if let SessionError::Stream(status) = &error
                && matches!(
                    status.code(),
                    Code::InvalidArgument | Code::ResourceExhausted
                )
            {
                match self.outbox.reject_oldest() {
                    Ok(Some(seq)) => tracing::error!(
                        seq,
                        reason = status.message(),
                        dropped_batches = self.outbox.dropped_batches(),
                        "collector rejected a batch; dropping it"
                    ),
                    Ok(None) => {}
                    Err(error) => tracing::error!(%error, "cannot drop the rejected batch"),
                }
                self.report_queue();
            }
            let delay = backoff.next_delay();
            tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, pending = self.outbox.pending_batches(), "uplink down");
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
            self.queue_registration(&inventory);
        }
        let batch = to_batch(&self.config.node, interval);
        let parts = batch_split::split(batch, &self.parent_of, batch_split::MAX_BATCH_BYTES);
        if parts.len() > 1 {
            tracing::debug!(
                parts = parts.len(),
                "an interval's batch is over {} bytes; sending it in parts",
                batch_split::MAX_BATCH_BYTES
            );
        }
        for part in parts {
            if let Err(error) = self.outbox.push_batch(part) {
                self.metrics.record_outbox_failure();
                tracing::error!(%error, "cannot queue an interval; it is lost");
            }
        }
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
            // A connection that died without a word (a rebooted collector
            // host, a dropped NAT entry) fails the call waiting on it, be
            // it a Register the collector holds or the stream, instead of
            // leaving the uplink waiting for good.
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        let endpoint = match &self.config.tls {
            Some(tls) => endpoint.tls_config(tls.clone())?,
            None => endpoint,
        };
        let Some(channel) = self
            .while_sampling(intervals, shutdown, endpoint.connect())
            .await
        else {
            return Ok(SessionEnd::Shutdown);
        };
        let channel: Channel = channel?;
        let mut client = IngestClient::with_interceptor(channel, Bearer(self.config.token.clone()));
        let Some(mut registration) = self.outbox.start_session()? else {
            return Err(OutboxError::NoRegistration.into());
        };
        let Some(committed) = self
            .register(&mut client, &registration, intervals, shutdown)
            .await?
        else {
            return Ok(SessionEnd::Shutdown);
        };
        backoff.reset();
        tracing::info!(collector = %self.config.collector_url, stream = %registration.boot_id, committed_seq = committed, replaying = self.outbox.pending_batches(), "connected to collector");

        let (outbound, outbound_rx) = mpsc::channel(self.config.max_in_flight.max(1));
        let Some(acks) = self
            .while_sampling(
                intervals,
                shutdown,
                client.stream(ReceiverStream::new(outbound_rx)),
            )
            .await
        else {
            return Ok(SessionEnd::Shutdown);
        };
        let mut acks = acks?.into_inner();
        // A registration read from the outbox waits until every batch before
        // it is accepted: those were sampled under the previous one, and the
        // collector takes a stream's batches in order, so once it has taken
        // them in it may judge the next ones by the new inventory.
        let mut next_registration: Option<pb::RegisterRequest> = None;
        loop {
            while next_registration.is_none()
                && self.outbox.in_flight_batches() < self.config.max_in_flight
            {
                match self.outbox.next_unsent()? {
                    Some(Record::Batch(batch)) => {
                        if outbound.try_send(batch).is_err() {
                            // The collector ended the call; its status says why.
                            return Err(self
                                .final_status(intervals, &mut acks, &registration.boot_id)
                                .await);
                        }
                    }
                    // Every spool segment starts with the registration it was
                    // written under; the same one again needs no round trip.
                    Some(Record::Register(r)) if r == registration => {}
                    Some(Record::Register(r)) => next_registration = Some(r),
                    None => break,
                }
            }
            if self.outbox.in_flight_batches() == 0
                && let Some(r) = next_registration.take()
            {
                let Some(committed) = self.register(&mut client, &r, intervals, shutdown).await?
                else {
                    return Ok(SessionEnd::Shutdown);
                };
                tracing::info!(stream = %r.boot_id, committed_seq = committed, "registered a new inventory");
                // Acks now speak of `r`'s stream. When that is a new one (the
                // spool started it over a damaged segment), the old stream's
                // accepted batches, and all after them, stay in the outbox
                // until the next session's Register says they are durable.
                registration = r;
                continue;
            }
            if !self.input_open && self.outbox.pending_batches() == 0 {
                return Ok(SessionEnd::Drained);
            }
            tokio::select! {
                changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return Ok(SessionEnd::Shutdown) },
                ack = acks.message() => match ack.map_err(SessionError::Stream)? {
                    Some(ack) => self.take_ack(&registration.boot_id, &ack)?,
                    None => return Err(SessionError::Closed),
                },
                interval = intervals.recv(), if self.input_open => self.accept(interval),
            }
        }
    }

    /// Reads what is left of a stream the collector ended: acks still in
    /// flight, then the status that ended it.
    async fn final_status(
        &mut self,
        intervals: &mut mpsc::Receiver<IntervalSamples>,
        acks: &mut tonic::Streaming<pb::Ack>,
        stream: &str,
    ) -> SessionError {
        loop {
            let message = tokio::select! {
                message = acks.message() => message,
                interval = intervals.recv(), if self.input_open => {
                    self.accept(interval);
                    continue;
                }
            };
            match message {
                Ok(Some(ack)) => {
                    if let Err(error) = self.take_ack(stream, &ack) {
                        return error.into();
                    }
                }
                Ok(None) => return SessionError::Closed,
                Err(status) => return SessionError::Stream(status),
            }
        }
    }

    /// Batches up to `accepted_seq` stop counting as in flight; those up to
    /// `committed_seq` are durable and leave the outbox. A collector that
    /// makes batches durable as it takes them in sends `accepted_seq` 0, and
    /// one that sends an accepted mark below the committed one is wrong
    /// about it: a durable batch is accepted, so the higher mark counts.
    fn take_ack(&mut self, stream: &str, ack: &pb::Ack) -> Result<(), OutboxError> {
        self.outbox
            .accept(stream, ack.accepted_seq.max(ack.committed_seq));
        self.outbox.ack(stream, ack.committed_seq)?;
        self.report_queue();
        Ok(())
    }

    /// Sends `registration` while sampling goes on (a collector whose
    /// database is down answers only once it is back), and forgets the
    /// batches the collector says it already committed. The committed seq,
    /// or `None` when the agent is told to stop first.
    async fn register(
        &mut self,
        client: &mut Client,
        registration: &pb::RegisterRequest,
        intervals: &mut mpsc::Receiver<IntervalSamples>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<u64>, SessionError> {
        let Some(answer) = self
            .while_sampling(intervals, shutdown, client.register(registration.clone()))
            .await
        else {
            return Ok(None);
        };
        let committed = answer?.into_inner().committed_seq;
        self.outbox.ack(&registration.boot_id, committed)?;
        Ok(Some(committed))
    }

    /// Awaits `call` while still taking the sampler's intervals into the
    /// outbox: the sampler blocks once its channel is full, so a collector
    /// slow to answer (its database down, a congested network) would
    /// otherwise stop polling and lose the spikes of that time. `None` when
    /// the agent is told to stop first.
    async fn while_sampling<T>(
        &mut self,
        intervals: &mut mpsc::Receiver<IntervalSamples>,
        shutdown: &mut watch::Receiver<bool>,
        call: impl Future<Output = T>,
    ) -> Option<T> {
        tokio::pin!(call);
        loop {
            tokio::select! {
                done = &mut call => return Some(done),
                changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return None },
                interval = intervals.recv(), if self.input_open => self.accept(interval),
            }
        }
    }

    fn report_queue(&self) {
        self.metrics.set_outbox(
            self.outbox.pending_batches(),
            self.outbox.accepted_batches(),
            self.outbox.dropped_batches(),
            self.outbox.stats(),
        );
    }
}

/// The stream id (`boot_id`) is stamped by the outbox.
fn to_register(config: &UplinkConfig, inventory: &Inventory) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node: config.node.clone(),
        boot_id: String::new(),
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

/// The stream id and sequence number are stamped by the outbox.
fn to_batch(node: &str, interval: IntervalSamples) -> pb::Batch {
    pb::Batch {
        node: node.to_owned(),
        boot_id: String::new(),
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
                slurm_account: p.last.owner.slurm_account.clone(),
                pod_namespace: p.last.owner.pod_namespace.clone(),
                process_group: p.last.owner.process_group,
                pod_labels: p.last.owner.pod_labels.iter().cloned().collect(),
                allocator: p.last.allocator.map(|a| pb::AllocatorStats {
                    timestamp_ms: a.timestamp_ms,
                    allocated_bytes: a.allocated_bytes,
                    reserved_bytes: a.reserved_bytes,
                    active_bytes: a.active_bytes,
                    inactive_split_bytes: a.inactive_split_bytes,
                    peak_allocated_bytes: a.peak_allocated_bytes,
                    alloc_retries: a.alloc_retries,
                    ooms: a.ooms,
                    composition: a.composition.map(to_composition),
                }),
            })
            .collect(),
        events: interval.events.into_iter().map(to_event).collect(),
    }
}

fn to_composition(c: headroom_common::Composition) -> pb::MemoryComposition {
    let part = |p: Option<headroom_common::Part>| {
        p.map(|p| pb::CompositionPart {
            bytes: p.bytes,
            dtype: p.dtype.as_str().to_owned(),
        })
    };
    pb::MemoryComposition {
        weights: part(c.weights),
        gradients: part(c.gradients),
        optimizer_state: part(c.optimizer_state),
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
