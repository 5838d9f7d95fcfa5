//! Everything the agent has produced and the collector has not yet made
//! durable, in order: batches and the registrations they were sampled under.
//!
//! The [`Outbox`] keeps two cursors over a [`RecordLog`]: `ack`, before which
//! the collector holds everything durably, and `send`, up to which this
//! session has put records on the wire. Between them, the collector may have
//! accepted a batch (taken it in, holding its samples in memory until a
//! flush) without making it durable yet: such a batch no longer counts as in
//! flight, but stays in the log, since a collector that restarts before its
//! flush loses it. A new session rewinds `send` to `ack`, so a batch whose
//! samples or ack were lost is sent again and the collector stores it once
//! by its `(node, stream, seq)`.
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

/// A batch the collector refused behind batches it accepted but has not
/// made durable: the log can only release its oldest records, so the batch
/// stays there, is skipped when read, and goes with those batches.
#[derive(Debug)]
struct Refused {
    stream: String,
    seq: u64,
    end: Position,
}

#[derive(Debug)]
pub struct Outbox {
    log: Box<dyn RecordLog>,
    ack: Position,
    send: Position,
    /// Records taken by this session and not yet durable, oldest first; the
    /// first `accepted` of them the collector has taken in.
    consumed: VecDeque<Consumed>,
    accepted: usize,
    /// Batches among the first `accepted` of `consumed`.
    accepted_batches: usize,
    /// Batches sent in this session and not yet accepted.
    in_flight_batches: usize,
    /// Skipped when read until the release passes them.
    refused: Vec<Refused>,
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
            accepted: 0,
            accepted_batches: 0,
            in_flight_batches: 0,
            refused: Vec::new(),
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

    /// Starts a session: everything not durable is to be sent again, what
    /// the collector only accepted too (a restarted collector lost it).
    /// Returns the registration to send first.
    pub fn start_session(&mut self) -> Result<Option<pb::RegisterRequest>, OutboxError> {
        self.consumed.clear();
        self.accepted = 0;
        self.accepted_batches = 0;
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
    /// every earlier batch is accepted.
    pub fn next_unsent(&mut self) -> Result<Option<Record>, OutboxError> {
        let (record, next) = loop {
            let Some((record, next)) = self.log.read(self.send)? else {
                return Ok(None);
            };
            self.send = next;
            match &record {
                Record::Batch(batch) if self.is_refused(batch) => {}
                _ => break (record, next),
            }
        };
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

    /// The collector took in every batch of `stream` up to `accepted`:
    /// they stop counting as in flight, and stay until they are durable.
    pub fn accept(&mut self, stream: &str, accepted: u64) {
        while let Some(record) = self.consumed.get(self.accepted) {
            match record {
                Consumed::Batch { stream: s, seq, .. } if s == stream && *seq <= accepted => {
                    self.in_flight_batches -= 1;
                    self.accepted_batches += 1;
                }
                Consumed::Register { .. } => {}
                Consumed::Batch { .. } => return,
            }
            self.accepted += 1;
        }
    }

    /// The collector holds every batch of `stream` up to `committed`
    /// durably: they leave the log. Durable implies accepted.
    pub fn ack(&mut self, stream: &str, committed: u64) -> Result<(), OutboxError> {
        self.accept(stream, committed);
        loop {
            match self.consumed.front() {
                Some(Consumed::Batch {
                    stream: s,
                    seq,
                    end,
                }) if s == stream && *seq <= committed => {
                    let end = *end;
                    self.pop_consumed(true);
                    self.advance_ack(end, true);
                }
                Some(Consumed::Register { registration, end }) => {
                    let end = *end;
                    self.registration = Some(registration.clone());
                    self.pop_consumed(false);
                    self.advance_ack(end, false);
                }
                Some(Consumed::Batch { .. }) => return Ok(()),
                // Nothing this session sent waits: the collector may already
                // hold batches it has not sent (stored before a restart).
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

    fn pop_consumed(&mut self, batch: bool) {
        self.consumed.pop_front();
        if self.accepted > 0 {
            self.accepted -= 1;
            if batch {
                self.accepted_batches -= 1;
            }
        } else if batch {
            self.in_flight_batches -= 1;
        }
    }

    /// The collector refused the oldest batch it had not accepted (it takes
    /// a stream's batches in order); resending it would fail forever. Drops
    /// it, ends the session, and returns its sequence number.
    pub fn reject_oldest(&mut self) -> Result<Option<u64>, OutboxError> {
        let oldest_in_flight =
            self.consumed
                .iter()
                .skip(self.accepted)
                .find_map(|record| match record {
                    Consumed::Batch { stream, seq, end } => Some(Refused {
                        stream: stream.clone(),
                        seq: *seq,
                        end: *end,
                    }),
                    Consumed::Register { .. } => None,
                });
        let accepted_ahead = self.accepted_batches > 0;
        self.start_session()?;
        match oldest_in_flight {
            // Batches that are not durable yet come before it in the log:
            // it waits there to be released with them.
            Some(refused) if accepted_ahead => {
                let seq = refused.seq;
                self.refused.push(refused);
                self.dropped += 1;
                Ok(Some(seq))
            }
            None if accepted_ahead => Ok(None),
            // It is the oldest batch the log holds.
            _ => match self.log.read(self.send)? {
                Some((Record::Batch(batch), next)) => {
                    self.send = next;
                    self.advance_ack(next, true);
                    self.dropped += 1;
                    Ok(Some(batch.seq))
                }
                _ => Ok(None),
            },
        }
    }

    fn is_refused(&self, batch: &pb::Batch) -> bool {
        self.refused
            .iter()
            .any(|r| r.seq == batch.seq && r.stream == batch.boot_id)
    }

    fn advance_ack(&mut self, upto: Position, batch: bool) {
        if upto > self.ack {
            self.ack = upto;
            self.log.release(upto, batch);
            self.refused.retain(|r| r.end > upto);
        }
    }

    /// Batches sent in this session and not yet accepted: what
    /// `max_in_flight` bounds.
    pub fn in_flight_batches(&self) -> usize {
        self.in_flight_batches
    }

    /// Batches the collector accepted in this session and has not yet made
    /// durable (it holds their samples in memory until a flush).
    pub fn accepted_batches(&self) -> usize {
        self.accepted_batches
    }

    /// Batches not yet durable, sent or not: what the log holds.
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
