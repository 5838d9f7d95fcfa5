//! The outbox log for agents without a spool directory: records in memory,
//! lost with the process. Each process is a new stream, numbered from 1, so
//! its batches are never mistaken for a previous run's.

use std::collections::BTreeMap;

use headroom_proto::v1 as pb;

use super::{OutboxError, Position, Record, RecordLog};

#[derive(Debug)]
pub struct MemoryLog {
    stream_id: String,
    max_batches: usize,
    /// Keyed by arrival; registrations stay when batches around them are
    /// dropped at the cap, so what follows still knows its inventory.
    records: BTreeMap<u64, Record>,
    next_index: u64,
    next_seq: u64,
    batches: usize,
}

impl MemoryLog {
    pub fn new(stream_id: String, max_batches: usize) -> Self {
        Self {
            stream_id,
            max_batches: max_batches.max(1),
            records: BTreeMap::new(),
            next_index: 0,
            next_seq: 1,
            batches: 0,
        }
    }

    fn push(&mut self, record: Record) {
        self.records.insert(self.next_index, record);
        self.next_index += 1;
    }
}

fn at(index: u64) -> Position {
    Position {
        segment: 0,
        offset: index,
    }
}

impl RecordLog for MemoryLog {
    fn stream_id(&self) -> &str {
        &self.stream_id
    }

    fn append_register(&mut self, registration: &pb::RegisterRequest) -> Result<(), OutboxError> {
        self.push(Record::Register(registration.clone()));
        Ok(())
    }

    fn append_batch(&mut self, batch: &mut pb::Batch) -> Result<(), OutboxError> {
        batch.seq = self.next_seq;
        self.next_seq += 1;
        self.push(Record::Batch(batch.clone()));
        self.batches += 1;
        Ok(())
    }

    fn first(&self) -> Position {
        at(self
            .records
            .keys()
            .next()
            .copied()
            .unwrap_or(self.next_index))
    }

    fn read(&mut self, from: Position) -> Result<Option<(Record, Position)>, OutboxError> {
        Ok(self
            .records
            .range(from.offset..)
            .next()
            .map(|(index, record)| (record.clone(), at(index + 1))))
    }

    fn release(&mut self, upto: Position, _batch: bool) {
        let kept = self.records.split_off(&upto.offset);
        let released = std::mem::replace(&mut self.records, kept);
        self.batches -= released
            .values()
            .filter(|r| matches!(r, Record::Batch(_)))
            .count();
    }

    fn enforce_cap(&mut self) -> u64 {
        let mut lost = 0;
        while self.batches > self.max_batches {
            let oldest = self
                .records
                .iter()
                .find(|(_, r)| matches!(r, Record::Batch(_)))
                .map(|(index, _)| *index);
            let Some(index) = oldest else { break };
            self.records.remove(&index);
            self.batches -= 1;
            lost += 1;
        }
        lost
    }

    fn pending_batches(&self) -> u64 {
        self.batches as u64
    }
}
