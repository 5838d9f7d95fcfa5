//! Coalesces the batches of many agent streams into few database writes.
//! Each stream hands its batch over and waits for the outcome; a few writer
//! tasks take whatever has queued up since their last write (up to a cap)
//! and store it in one transaction. Under light load a write carries one
//! batch and waits for nothing; under heavy load the queue fills while a
//! write is in flight, and the next write carries all of it, so the
//! per-transaction cost is shared by many batches.
//!
//! The queue is bounded: when the database falls behind, streams wait to
//! hand their batch over, stop reading from the network, and HTTP/2 flow
//! control holds the agents back, which spool. Memory stays bounded by the
//! queue and the streams.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::metrics::CollectorMetrics;
use headroom_store::model::{StoreBatch, WriteOutcome};
use headroom_store::{Store, StoreError};

/// How the writers share the database.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WriterConfig {
    /// Concurrent writes; 0 picks 2 where the database takes parallel
    /// writes (Postgres: one commits while the next is built) and 1 where it
    /// does not (SQLite).
    pub writers: u32,
    /// Most batches one write carries.
    pub max_batches_per_write: u32,
    /// Batches waiting for a writer before streams are made to wait.
    pub queue_batches: u32,
}

impl Default for WriterConfig {
    fn default() -> Self {
        Self {
            writers: 0,
            max_batches_per_write: 256,
            queue_batches: 1024,
        }
    }
}

impl WriterConfig {
    /// A problem with the values, named, or `None`.
    pub fn problem(&self) -> Option<String> {
        (self.max_batches_per_write == 0 || self.queue_batches == 0).then(|| {
            "ingest.max_batches_per_write and ingest.queue_batches must be at least 1".into()
        })
    }

    fn writers_for(&self, parallel_writes: bool) -> usize {
        match self.writers {
            0 if parallel_writes => 2,
            0 => 1,
            n => n as usize,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{0}")]
    Store(Arc<StoreError>),
    #[error("the collector is shutting down")]
    Closed,
}

/// A batch back from its writer, with what became of it.
#[derive(Debug)]
pub struct Written {
    pub batch: StoreBatch,
    pub outcome: Result<WriteOutcome, WriteError>,
}

struct Pending {
    batch: StoreBatch,
    reply: oneshot::Sender<Written>,
}

#[derive(Debug, Clone)]
pub struct Coalescer {
    queue: mpsc::Sender<Pending>,
}

impl Coalescer {
    /// Starts the writer tasks; they end once every `Coalescer` clone is
    /// dropped and the queue is drained.
    pub fn start(
        store: Arc<dyn Store>,
        config: &WriterConfig,
        metrics: Arc<CollectorMetrics>,
    ) -> Self {
        let (queue, rx) = mpsc::channel(config.queue_batches.max(1) as usize);
        let rx = Arc::new(Mutex::new(rx));
        let max = config.max_batches_per_write.max(1) as usize;
        for _ in 0..config.writers_for(store.parallel_writes()) {
            tokio::spawn(writer(store.clone(), rx.clone(), max, metrics.clone()));
        }
        Self { queue }
    }

    /// Stores `batch` with whatever else is waiting; returns after commit.
    pub async fn write(&self, batch: StoreBatch) -> Written {
        let (reply, outcome) = oneshot::channel();
        if let Err(mpsc::error::SendError(pending)) =
            self.queue.send(Pending { batch, reply }).await
        {
            return Written {
                batch: pending.batch,
                outcome: Err(WriteError::Closed),
            };
        }
        // A writer only drops the reply if its task died mid-write; the
        // batch was moved there, so the stream fails and the agent resends.
        outcome.await.unwrap_or_else(|_| Written {
            batch: StoreBatch::default(),
            outcome: Err(WriteError::Closed),
        })
    }
}

async fn writer(
    store: Arc<dyn Store>,
    rx: Arc<Mutex<mpsc::Receiver<Pending>>>,
    max: usize,
    metrics: Arc<CollectorMetrics>,
) {
    let mut group: Vec<Pending> = Vec::with_capacity(max);
    loop {
        {
            // One writer gathers at a time; the others are writing.
            let mut rx = rx.lock().await;
            if rx.recv_many(&mut group, max).await == 0 {
                return;
            }
        }
        let (batches, replies): (Vec<StoreBatch>, Vec<oneshot::Sender<Written>>) =
            group.drain(..).map(|p| (p.batch, p.reply)).unzip();
        metrics.write_group(batches.len());
        let outcomes = match store.write_batches(&batches).await {
            Ok(outcomes) if outcomes.len() == batches.len() => {
                outcomes.into_iter().map(Ok).collect()
            }
            Ok(outcomes) => {
                tracing::error!(
                    batches = batches.len(),
                    outcomes = outcomes.len(),
                    "the store returned the wrong number of outcomes; retrying one by one"
                );
                one_by_one(&*store, &batches).await
            }
            Err(error) if batches.len() > 1 => {
                // One bad batch must not fail the others: redo them alone.
                tracing::warn!(%error, batches = batches.len(), "a grouped write failed; retrying one by one");
                metrics.write_group_split();
                one_by_one(&*store, &batches).await
            }
            Err(error) => vec![Err(WriteError::Store(Arc::new(error)))],
        };
        for ((batch, reply), outcome) in batches.into_iter().zip(replies).zip(outcomes) {
            // The stream may have gone (agent disconnected): nothing to tell.
            let _ = reply.send(Written { batch, outcome });
        }
    }
}

async fn one_by_one(
    store: &dyn Store,
    batches: &[StoreBatch],
) -> Vec<Result<WriteOutcome, WriteError>> {
    let mut outcomes = Vec::with_capacity(batches.len());
    for batch in batches {
        outcomes.push(
            store
                .write_batch(batch)
                .await
                .map_err(|e| WriteError::Store(Arc::new(e))),
        );
    }
    outcomes
}
