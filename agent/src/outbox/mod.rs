//! Everything the agent has produced and the collector has not yet
//! acknowledged, in order: batches and the registrations they were sampled
//! under.
//!
//! The [`Outbox`] keeps two cursors over a [`RecordLog`]: `ack`, before which
//! the collector holds everything, and `send`, up to which this session has
//! put records on the wire. A new session rewinds `send` to `ack`, so a batch
//! whose ack was lost is sent again and the collector stores it once by its
//! `(node, stream, seq)`.
//!
//! Sequence numbers are handed out when a batch is queued, by the log: the
//! memory log starts a fresh stream per process; the disk [`spool::Spool`]
//! persists its stream and the numbers it reserved, so a restarted agent
//! carries on where it stopped and never reuses a number the collector may
//! hold.

mod frame;
pub mod memory;
pub mod spool;

use std::collections::VecDeque;
use std::path::PathBuf;

use headroom_proto::v1 as pb;

pub use memory::MemoryLog;
pub use spool::{Spool, SpoolConfig};

#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    #[error("spool {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("spool directory {0} is in use by another agent (two agents must not share a spool)")]
    Locked(PathBuf),
    #[error("a batch was queued before any registration")]
    NoRegistration,
}

impl OutboxError {
    fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}

/// One entry of the log.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Register(pb::RegisterRequest),
    Batch(pb::Batch),
}

/// A place in a log; ordered as the records are. The memory log uses
/// `segment` 0 and counts records in `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Position {
    pub segment: u64,
    pub offset: u64,
}

/// What a log reports about itself beyond the batches it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogStats {
    pub bytes: u64,
    pub segments: u64,
    pub corrupt_segments: u64,
}

/// Where records wait: memory, or segment files on disk.
pub trait RecordLog: Send + std::fmt::Debug {
    /// The stream the log's records belong to (sent as the `boot_id`);
    /// the outbox stamps it on everything it appends.
    fn stream_id(&self) -> &str;
    fn append_register(&mut self, registration: &pb::RegisterRequest) -> Result<(), OutboxError>;
    /// Gives the batch its sequence number in the stream and appends it.
    fn append_batch(&mut self, batch: &mut pb::Batch) -> Result<(), OutboxError>;
    /// The oldest place that still holds data.
    fn first(&self) -> Position;
    /// The record at `at` or the first one after it, with the position
    /// after it; `None` at the end.
    fn read(&mut self, at: Position) -> Result<Option<(Record, Position)>, OutboxError>;
    /// The collector holds everything before `upto`; `batch` says whether
    /// the record that ends there is a batch.
    fn release(&mut self, upto: Position, batch: bool);
    /// Drops the oldest data while the log is over its size cap; returns how
    /// many unacknowledged batches went with it.
    fn enforce_cap(&mut self) -> u64;
    /// Batches held and not yet acknowledged.
    fn pending_batches(&self) -> u64;
    fn stats(&self) -> LogStats {
        LogStats::default()
    }
}

#[derive(Debug)]
enum Consumed {
    Batch {
        stream: String,
        seq: u64,
        end: Position,
    },
    Register {
        registration: pb::RegisterRequest,
        end: Position,
    },
}

#[derive(Debug)]
pub struct Outbox {
    log: Box<dyn RecordLog>,
    ack: Position,
    send: Position,
    /// Records taken by this session and not yet acknowledged, oldest first.
    consumed: VecDeque<Consumed>,
    in_flight_batches: usize,
    /// The registration the records from `ack` on were produced under.
    registration: Option<pb::RegisterRequest>,
    dropped: u64,
}

impl Outbox {
    pub fn new(log: Box<dyn RecordLog>) -> Self {
        let first = log.first();
        Self {
            log,
            ack: first,
            send: first,
            consumed: VecDeque::new(),
            in_flight_batches: 0,
            registration: None,
            dropped: 0,
        }
    }

    pub fn stream_id(&self) -> &str {
        self.log.stream_id()
    }

    pub fn push_register(
        &mut self,
        mut registration: pb::RegisterRequest,
    ) -> Result<(), OutboxError> {
        registration.boot_id = self.log.stream_id().to_owned();
        self.log.append_register(&registration)?;
        self.after_append();
        Ok(())
    }

    /// Queues a batch; returns its sequence number.
    pub fn push_batch(&mut self, mut batch: pb::Batch) -> Result<u64, OutboxError> {
        batch.boot_id = self.log.stream_id().to_owned();
        self.log.append_batch(&mut batch)?;
        self.after_append();
        Ok(batch.seq)
    }

    fn after_append(&mut self) {
        let lost = self.log.enforce_cap();
        if lost == 0 {
            return;
        }
        self.dropped += lost;
        let first = self.log.first();
        self.ack = self.ack.max(first);
        self.send = self.send.max(first);
        tracing::warn!(
            lost_batches = lost,
            dropped_total = self.dropped,
            "outbox full; dropped the oldest batches"
        );
    }

    /// Starts a session: everything not acknowledged is to be sent again.
    /// Returns the registration to send first.
    pub fn start_session(&mut self) -> Result<Option<pb::RegisterRequest>, OutboxError> {
        self.consumed.clear();
        self.in_flight_batches = 0;
        self.send = self.ack;
        self.skip_registrations()?;
        Ok(self.registration.clone())
    }

    /// Moves both cursors over registrations at the front: the session
    /// registers the newest of them instead of replaying each.
    fn skip_registrations(&mut self) -> Result<(), OutboxError> {
        while let Some((Record::Register(registration), next)) = self.log.read(self.send)? {
            self.registration = Some(registration);
            self.send = next;
            self.advance_ack(next, false);
        }
        Ok(())
    }

    /// The next record to put on the wire. A registration must reach the
    /// collector before the batches after it; the caller sends it once
    /// every earlier batch is acknowledged.
    pub fn next_unsent(&mut self) -> Result<Option<Record>, OutboxError> {
        let Some((record, next)) = self.log.read(self.send)? else {
            return Ok(None);
        };
        self.send = next;
        self.consumed.push_back(match &record {
            Record::Batch(batch) => {
                self.in_flight_batches += 1;
                Consumed::Batch {
                    stream: batch.boot_id.clone(),
                    seq: batch.seq,
                    end: next,
                }
            }
            Record::Register(registration) => Consumed::Register {
                registration: registration.clone(),
                end: next,
            },
        });
        Ok(Some(record))
    }

    /// The collector holds every batch of `stream` up to `committed`.
    pub fn ack(&mut self, stream: &str, committed: u64) -> Result<(), OutboxError> {
        loop {
            match self.consumed.front() {
                Some(Consumed::Batch {
                    stream: s,
                    seq,
                    end,
                }) if s == stream && *seq <= committed => {
                    let end = *end;
                    self.consumed.pop_front();
                    self.in_flight_batches -= 1;
                    self.advance_ack(end, true);
                }
                Some(Consumed::Register { registration, end }) => {
                    let end = *end;
                    self.registration = Some(registration.clone());
                    self.consumed.pop_front();
                    self.advance_ack(end, false);
                }
                Some(Consumed::Batch { .. }) => return Ok(()),
                // Nothing in flight: the collector may already hold batches
                // this session has not sent (it stored them before a restart).
                None => match self.log.read(self.send)? {
                    Some((Record::Batch(batch), next))
                        if batch.boot_id == stream && batch.seq <= committed =>
                    {
                        self.send = next;
                        self.advance_ack(next, true);
                    }
                    _ => return Ok(()),
                },
            }
        }
    }

    /// The collector refused the oldest unacknowledged batch; resending it
    /// would fail forever. Drops it and returns its sequence number.
    pub fn reject_oldest(&mut self) -> Result<Option<u64>, OutboxError> {
        self.start_session()?;
        match self.log.read(self.send)? {
            Some((Record::Batch(batch), next)) => {
                self.send = next;
                self.advance_ack(next, true);
                self.dropped += 1;
                Ok(Some(batch.seq))
            }
            _ => Ok(None),
        }
    }

    fn advance_ack(&mut self, upto: Position, batch: bool) {
        if upto > self.ack {
            self.ack = upto;
            self.log.release(upto, batch);
        }
    }

    /// Batches sent in this session and not yet acknowledged.
    pub fn in_flight_batches(&self) -> usize {
        self.in_flight_batches
    }

    /// Batches not yet acknowledged, sent or not.
    pub fn pending_batches(&self) -> u64 {
        self.log.pending_batches()
    }

    /// Batches lost: dropped at the size cap, or refused by the collector.
    pub fn dropped_batches(&self) -> u64 {
        self.dropped
    }

    pub fn stats(&self) -> LogStats {
        self.log.stats()
    }
}

#[cfg(test)]
mod tests;
