//! The gRPC service. Each stream is served by one task that handles its
//! batches strictly in order: validate, hand over to the writers (which
//! commit it with other streams' batches), then ack. An ack is only ever
//! sent after the commit, so an agent that forgets a batch on ack can never
//! lose it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use futures::Stream;
use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_server::Ingest;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::auth::{AgentAuth, Caller};
use super::coalesce::{Coalescer, WriteError, Written};
use super::validate::{self, Clipped, Limits};
use crate::alerts::Alerting;
use crate::metrics::{BatchOutcome, CollectorMetrics};
use headroom_common::Clock;
use headroom_store::model::{NodeSession, WriteOutcome};
use headroom_store::{Store, StoreError};

/// Sessions by node, then by boot: looked up by borrowed names, with no
/// key built per batch. At most `max_sessions_per_node` boots per node.
type Sessions = HashMap<String, HashMap<String, CachedSession>>;

#[derive(Debug)]
struct CachedSession {
    session: Arc<NodeSession>,
    /// Highest seq known committed for the boot: a batch numbered far
    /// beyond it is refused rather than allowed to mark the stream's next
    /// batches as replays.
    committed: Arc<AtomicU64>,
    /// When the session was last used, on the collector's use counter: the
    /// least recent goes first.
    last_used: AtomicU64,
}

/// A batch's session and its boot's committed watermark.
type SessionHandle = (Arc<NodeSession>, Arc<AtomicU64>);

#[derive(Debug)]
struct Inner {
    store: Arc<dyn Store>,
    auth: Arc<AgentAuth>,
    writers: Coalescer,
    limits: Limits,
    clock: Clock,
    alerting: Option<Arc<Alerting>>,
    sessions: RwLock<Sessions>,
    uses: AtomicU64,
    metrics: Arc<CollectorMetrics>,
}

#[derive(Debug, Clone)]
pub struct IngestService {
    inner: Arc<Inner>,
}

impl IngestService {
    pub fn new(
        store: Arc<dyn Store>,
        auth: Arc<AgentAuth>,
        writers: Coalescer,
        limits: Limits,
        clock: Clock,
        alerting: Option<Arc<Alerting>>,
        metrics: Arc<CollectorMetrics>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                auth,
                writers,
                limits,
                clock,
                alerting,
                sessions: RwLock::new(HashMap::new()),
                uses: AtomicU64::new(0),
                metrics,
            }),
        }
    }
}

impl Inner {
    /// Who sent `request`, by its token, and from where.
    async fn caller<T>(&self, request: &Request<T>) -> Result<(Caller, Option<IpAddr>), Status> {
        let peer = request.remote_addr().map(|a| a.ip());
        let caller = self.auth.authenticate(request.metadata(), peer).await?;
        Ok((caller, peer))
    }

    fn cached(&self, node: &str, boot_id: &str) -> Option<SessionHandle> {
        let sessions = self.sessions.read().ok()?;
        let cached = sessions.get(node)?.get(boot_id)?;
        cached
            .last_used
            .store(self.uses.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
        Some((cached.session.clone(), cached.committed.clone()))
    }

    fn remember(&self, session: NodeSession) -> SessionHandle {
        let session = Arc::new(session);
        let committed = Arc::new(AtomicU64::new(session.committed_seq));
        if let Ok(mut sessions) = self.sessions.write() {
            // A node's devices change only on registration; older boots of the
            // node keep their (now stale) device map until they stop sending.
            let boots = sessions.entry(session.node.clone()).or_default();
            boots.insert(
                session.boot_id.clone(),
                CachedSession {
                    session: session.clone(),
                    committed: committed.clone(),
                    last_used: AtomicU64::new(self.uses.fetch_add(1, Ordering::Relaxed)),
                },
            );
            // An evicted boot that sends again is reloaded from the store:
            // the cap bounds memory, not what a node may do.
            while boots.len() > self.limits.max_sessions_per_node {
                let Some(oldest) = boots
                    .iter()
                    .min_by_key(|(_, c)| c.last_used.load(Ordering::Relaxed))
                    .map(|(boot, _)| boot.clone())
                else {
                    break;
                };
                boots.remove(&oldest);
            }
        }
        (session, committed)
    }

    /// The session a batch belongs to; after a collector restart it is
    /// reloaded from the store, so agents need not register again.
    async fn session_for(&self, node: &str, boot_id: &str) -> Result<SessionHandle, Status> {
        if let Some(session) = self.cached(node, boot_id) {
            return Ok(session);
        }
        match self.store.session(node, boot_id).await {
            Ok(Some(session)) => Ok(self.remember(session)),
            Ok(None) => Err(Status::failed_precondition(format!(
                "node {node:?} (boot {boot_id:?}) sent a batch before Register"
            ))),
            Err(error) => {
                self.metrics.storage_error();
                tracing::error!(%error, node, "loading the agent session failed");
                Err(Status::unavailable(format!("storage unavailable: {error}")))
            }
        }
    }

    /// Handles one batch; the ack is the highest committed seq.
    async fn ingest(&self, batch: pb::Batch) -> Result<pb::Ack, Status> {
        let node = batch.node.as_str();
        if node.is_empty() || batch.boot_id.is_empty() {
            return Err(Status::invalid_argument(format!(
                "batch seq {} has an empty node or boot_id",
                batch.seq
            )));
        }
        if node.len() > 253 || batch.boot_id.len() > self.limits.max_id_len {
            return Err(Status::invalid_argument(format!(
                "batch seq {}: node or boot_id too long",
                batch.seq
            )));
        }
        let (session, committed) = self.session_for(node, &batch.boot_id).await?;
        let seq = batch.seq;
        let node = session.node.as_str();
        let watermark = committed.load(Ordering::Relaxed);
        if seq > watermark.saturating_add(self.limits.max_seq_gap) {
            self.metrics.batch(BatchOutcome::Rejected);
            tracing::warn!(
                node,
                seq,
                committed_seq = watermark,
                "rejected a batch numbered far ahead of its stream"
            );
            return Err(Status::invalid_argument(format!(
                "batch seq {seq} from node {node} is more than {} ahead of the stream's committed seq {watermark} ([limits] max_seq_gap)",
                self.limits.max_seq_gap
            )));
        }
        let rows = validate::batch(batch, &session, self.clock.now_ms(), &self.limits).map_err(
            |invalid| {
                self.metrics.batch(BatchOutcome::Rejected);
                tracing::warn!(node, seq, reason = %invalid, "rejected batch");
                Status::invalid_argument(format!("batch seq {seq} from node {node}: {invalid}"))
            },
        )?;
        let started = std::time::Instant::now();
        let Written {
            batch: rows,
            outcome,
        } = self.writers.write(rows).await;
        self.metrics.write_took(started.elapsed());
        match outcome {
            Ok(WriteOutcome::Committed) => {
                self.metrics.batch(BatchOutcome::Committed);
                self.metrics.stored(
                    rows.gpu_samples.len(),
                    rows.process_samples.len(),
                    rows.events.len(),
                );
                // Rules see a batch once, after it is safely stored; replays
                // are not judged twice.
                committed.fetch_max(seq, Ordering::Relaxed);
                if let Some(alerting) = &self.alerting {
                    alerting.observe_batch(&session, &rows).await;
                }
                Ok(self.ack(&session, seq))
            }
            Ok(WriteOutcome::Replayed) => {
                self.metrics.batch(BatchOutcome::Replayed);
                tracing::debug!(
                    node,
                    seq,
                    "replayed batch accepted before; its samples taken again"
                );
                committed.fetch_max(seq, Ordering::Relaxed);
                Ok(self.ack(&session, seq))
            }
            Ok(WriteOutcome::Duplicate { committed_seq }) => {
                self.metrics.batch(BatchOutcome::Duplicate);
                tracing::debug!(node, seq, committed_seq, "replayed batch already stored");
                committed.fetch_max(committed_seq, Ordering::Relaxed);
                // Where samples wait in open chunks, `committed_seq` is the
                // durable mark; otherwise every batch up to `seq` is stored.
                let durable = match self.store.durable_seq(session.node_id, &session.boot_id) {
                    Some(held) => held.max(committed_seq),
                    None => committed_seq.max(seq),
                };
                Ok(pb::Ack {
                    committed_seq: durable,
                    accepted_seq: committed_seq.max(seq),
                })
            }
            Err(WriteError::Closed) => {
                self.metrics.batch(BatchOutcome::Failed);
                Err(Status::unavailable("the collector is shutting down"))
            }
            Err(WriteError::Store(error)) => {
                self.metrics.batch(BatchOutcome::Failed);
                self.metrics.storage_error();
                tracing::error!(%error, node, seq, "writing a batch failed");
                Err(Status::unavailable(format!("storage unavailable: {error}")))
            }
        }
    }
}

impl Inner {
    /// A new ack for the stream of `node` and `boot` when its durable mark
    /// moved past `last` (which it then becomes); `None` when it did not.
    fn durable_news(&self, node: &str, boot: &str, last: &mut pb::Ack) -> Option<pb::Ack> {
        let (session, _) = self.cached(node, boot)?;
        let durable = self
            .store
            .durable_seq(session.node_id, &session.boot_id)?
            .min(last.accepted_seq);
        (durable > last.committed_seq).then(|| {
            last.committed_seq = durable;
            *last
        })
    }

    /// The ack for batch `seq` of `session`'s stream, taken in: durable as
    /// far as the store says (samples in open chunks are not yet), and at
    /// least as far as when the session was loaded (a store forgets the
    /// marks of streams that went idle).
    fn ack(&self, session: &NodeSession, seq: u64) -> pb::Ack {
        let durable = self
            .store
            .durable_seq(session.node_id, &session.boot_id)
            .map_or(seq, |durable| durable.max(session.durable_seq).min(seq));
        pb::Ack {
            committed_seq: durable,
            accepted_seq: seq,
        }
    }

    /// The status for a registration the store did not take: a refusal the
    /// agent's operator must act on, or storage trouble to wait out.
    fn registration_refused(&self, node: &str, error: StoreError) -> Status {
        match error {
            StoreError::DeviceOwned { .. } => {
                self.metrics.registration_refused();
                tracing::warn!(node, %error, "refused a registration: it claims another node's device");
                Status::failed_precondition(format!("Register from node {node}: {error}"))
            }
            StoreError::TooManyDevices { .. } => {
                self.metrics.registration_refused();
                tracing::warn!(node, %error, "refused a registration: too many devices");
                Status::resource_exhausted(format!("Register from node {node}: {error}"))
            }
            error => {
                self.metrics.storage_error();
                tracing::error!(%error, node, "storing a registration failed");
                Status::unavailable(format!("storage unavailable: {error}"))
            }
        }
    }
}

/// Counts a stream as open for as long as its task lives, however it ends.
struct StreamOpen(Arc<CollectorMetrics>);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        self.0.stream_closed();
    }
}

/// The refusal for a message tonic would not decode because of its size.
fn oversized(status: &Status, limit: usize) -> Option<Status> {
    let too_large = matches!(
        status.code(),
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
    ) && status.message().contains("too large");
    too_large.then(|| {
        Status::resource_exhausted(format!(
            "{}; the collector takes messages of up to {limit} bytes ([limits] max_message_bytes)",
            status.message()
        ))
    })
}

type AckStream = Pin<Box<dyn Stream<Item = Result<pb::Ack, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Ingest for IngestService {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let (caller, peer) = self.inner.caller(&request).await?;
        let request = request.into_inner();
        self.inner.auth.check_node(&caller, &request.node, peer)?;
        let registration =
            validate::registration(&request, &self.inner.limits).map_err(|invalid| {
                tracing::warn!(node = %Clipped(&request.node), reason = %invalid, "rejected registration");
                Status::invalid_argument(format!(
                    "Register from node {}: {invalid}",
                    Clipped(&request.node)
                ))
            })?;
        let session = self
            .inner
            .store
            .register(&registration, self.inner.clock.now_ms())
            .await
            .map_err(|error| self.inner.registration_refused(&registration.node, error))?;
        tracing::info!(node = %session.node, boot_id = %session.boot_id, devices = session.device_ids.len(),
            committed_seq = session.committed_seq, durable_seq = session.durable_seq, "agent registered");
        // The agent sends again everything after this; what was accepted
        // but not yet durable is taken as a replay.
        let committed_seq = session.durable_seq;
        self.inner.metrics.registered();
        if let Some(alerting) = &self.inner.alerting {
            alerting.node_registered(&session.node, registration.sample_interval_ms);
        }
        self.inner.remember(session);
        Ok(Response::new(pb::RegisterResponse { committed_seq }))
    }

    type StreamStream = AckStream;

    async fn stream(
        &self,
        request: Request<Streaming<pb::Batch>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let (caller, peer) = self.inner.caller(&request).await?;
        let mut batches = request.into_inner();
        // Small: an agent cannot run far ahead of what the database commits,
        // which is how a slow database slows agents down.
        let (acks, acks_rx) = mpsc::channel(4);
        let inner = self.inner.clone();
        tokio::spawn(async move {
            inner.metrics.stream_opened();
            let _open = StreamOpen(inner.metrics.clone());
            // The stream's last ack: once a flush makes more of it durable,
            // the agent hears so even if it sends nothing more (an agent
            // that throttles on the durable mark would otherwise wait for
            // an ack that only its next batch could bring).
            let mut last: Option<(String, String, pb::Ack)> = None;
            let mut durable_check = tokio::time::interval(std::time::Duration::from_secs(1));
            durable_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let batch = tokio::select! {
                    batch = batches.next() => batch,
                    _ = durable_check.tick() => {
                        if let Some(ack) = last.as_mut().and_then(|(node, boot, ack)| inner.durable_news(node, boot, ack))
                            && acks.send(Ok(ack)).await.is_err()
                        {
                            return;
                        }
                        continue;
                    }
                };
                let Some(batch) = batch else { return };
                let stream = match &batch {
                    Ok(batch) => Some((batch.node.clone(), batch.boot_id.clone())),
                    Err(_) => None,
                };
                let result = match batch {
                    Ok(batch) => match inner
                        .auth
                        .still_valid(&caller, peer)
                        .await
                        .and_then(|()| inner.auth.check_node(&caller, &batch.node, peer))
                    {
                        Ok(()) => inner.ingest(batch).await,
                        Err(refused) => Err(refused),
                    },
                    Err(status) => {
                        // A message over the size limit cannot be skipped (the
                        // stream's framing is lost), so the stream ends with a
                        // status the agent acts on instead of a silent close.
                        if let Some(refused) = oversized(&status, inner.limits.max_message_bytes) {
                            inner.metrics.batch(BatchOutcome::Rejected);
                            tracing::warn!(peer = ?peer, reason = %refused.message(), "refused an oversized batch");
                            let _ = acks.send(Err(refused)).await;
                        } else {
                            tracing::debug!(%status, "agent stream ended with an error");
                        }
                        return;
                    }
                };
                if let (Ok(ack), Some((node, boot))) = (&result, stream) {
                    last = Some((node, boot, *ack));
                }
                let failed = result.is_err();
                if acks.send(result).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(
            Box::pin(ReceiverStream::new(acks_rx)) as AckStream
        ))
    }
}
