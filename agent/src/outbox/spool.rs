//! The outbox log on disk, so that batches outlive a collector outage, an
//! agent restart and a host reboot.
//!
//! The directory holds numbered segment files (`00000000000000000001.seg`),
//! appended to in order and deleted whole: once the collector has
//! acknowledged everything in them, or, at the size cap, the oldest first
//! (its unacknowledged batches are counted as dropped and logged). Every
//! segment starts with the registration its batches were sampled under and
//! the stream's sequence reservation, so each one can be replayed on its own.
//!
//! Durability: every record is written with one `write` as it is queued, so
//! a killed agent loses nothing. `fsync` runs at most every
//! `fsync_interval` (zero: after every batch), so a host crash can lose the
//! batches of the last interval, no more. Sequence reservations and new
//! segments are synced at once: a restarted agent never hands out a number
//! the collector may already hold.
//!
//! A segment that fails its checksum is logged, counted and cut at the last
//! good record; a torn last record (the agent died mid-write) is cut quietly.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, Seek, SeekFrom, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use headroom_proto::v1 as pb;
use prost::Message;

use super::frame::{self, Frame, HEADER_LEN, Kind, MAGIC};
use super::{LogStats, OutboxError, Position, Record, RecordLog};

/// Sequence numbers reserved (and synced) at a time: one `fsync` per this
/// many batches. A restart skips what was left of the block; the collector
/// only needs numbers to grow.
const RESERVE_BLOCK: u64 = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolConfig {
    pub dir: PathBuf,
    /// All segments together; past it the oldest segment is dropped.
    pub max_bytes: u64,
    /// A segment is closed and a new one started past this size.
    pub segment_bytes: u64,
    /// Longest time a queued batch may sit in the page cache unsynced.
    pub fsync_interval: Duration,
}

#[derive(Debug)]
struct Segment {
    number: u64,
    /// Length of the valid records, header included.
    bytes: u64,
    batches: u64,
}

#[derive(Debug)]
struct Reader {
    number: u64,
    offset: u64,
    file: BufReader<File>,
}

#[derive(Debug)]
pub struct Spool {
    config: SpoolConfig,
    /// Held for the life of the spool: two agents on one directory would
    /// interleave their streams.
    _lock: File,
    stream_id: String,
    /// Oldest first; the last one is appended to once `active` is open.
    segments: VecDeque<Segment>,
    active: Option<File>,
    next_number: u64,
    reader: Option<Reader>,
    next_seq: u64,
    reserved_through: u64,
    latest_registration: Option<pb::RegisterRequest>,
    /// Batches of the first segment the collector already holds.
    acked_in_first: u64,
    corrupt_segments: u64,
    last_sync: Instant,
    unsynced: bool,
}

/// What a scan of one segment file found.
#[derive(Debug, Default)]
struct Scan {
    valid_bytes: u64,
    batches: u64,
    head: Option<pb::RegisterRequest>,
    latest_registration: Option<pb::RegisterRequest>,
    reserved_through: Option<u64>,
    /// Why the scan stopped before the end of the file, and whether it was
    /// only a torn last write.
    problem: Option<(String, bool)>,
}

impl Spool {
    /// Opens (or creates) the spool in `config.dir` and recovers what an
    /// earlier run left there.
    pub fn open(config: SpoolConfig) -> Result<Self, OutboxError> {
        let dir = config.dir.clone();
        // Batches name users, jobs and commands: for the agent's eyes only.
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(OutboxError::io(&dir))?;
        let lock_path = dir.join("lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(OutboxError::io(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(OutboxError::Locked(dir)),
            Err(fs::TryLockError::Error(source)) => {
                return Err(OutboxError::Io {
                    path: lock_path,
                    source,
                });
            }
        }
        let mut numbers = Vec::new();
        for entry in fs::read_dir(&dir).map_err(OutboxError::io(&dir))? {
            let entry = entry.map_err(OutboxError::io(&dir))?;
            let name = entry.file_name();
            if let Some(number) = name
                .to_str()
                .and_then(|n| n.strip_suffix(".seg"))
                .and_then(|n| n.parse::<u64>().ok())
            {
                numbers.push(number);
            }
        }
        numbers.sort_unstable();

        let mut segments = VecDeque::new();
        let mut corrupt_segments = 0;
        let mut newest: Option<Scan> = None;
        // Damage (not a torn write) in the newest file may have hidden its
        // latest sequence reservation.
        let mut newest_damaged = false;
        for (index, number) in numbers.iter().enumerate() {
            let path = segment_path(&dir, *number);
            let mut scan = scan_segment(&path).map_err(OutboxError::io(&path))?;
            if index + 1 == numbers.len() {
                newest_damaged = matches!(scan.problem, Some((_, false)));
            }
            // Only the newest segment can end in a torn write: a segment is
            // synced before the next one is created.
            if index + 1 < numbers.len()
                && let Some((_, torn)) = scan.problem.as_mut()
            {
                *torn = false;
            }
            if scan.head.is_none() {
                match &scan.problem {
                    // Created just before the agent or host stopped.
                    None | Some((_, true)) => {
                        tracing::warn!(path = %path.display(), "spool segment was never completed; removing it");
                    }
                    Some((why, false)) => {
                        corrupt_segments += 1;
                        let why = if why.is_empty() {
                            "truncated"
                        } else {
                            why.as_str()
                        };
                        tracing::error!(path = %path.display(), reason = %why, "spool segment has no readable head; dropping it");
                    }
                }
                fs::remove_file(&path).map_err(OutboxError::io(&path))?;
                continue;
            }
            if let Some((why, torn)) = &scan.problem {
                let lost = fs::metadata(&path)
                    .map(|m| m.len().saturating_sub(scan.valid_bytes))
                    .unwrap_or(0);
                if *torn {
                    tracing::warn!(path = %path.display(), lost_bytes = lost, "spool segment ends in a torn write (the agent or host stopped mid-write); cutting it");
                } else {
                    corrupt_segments += 1;
                    tracing::error!(path = %path.display(), offset = scan.valid_bytes, lost_bytes = lost, reason = %why, "corrupt spool record; skipping the rest of the segment");
                }
                let file = OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(OutboxError::io(&path))?;
                file.set_len(scan.valid_bytes)
                    .map_err(OutboxError::io(&path))?;
            }
            segments.push_back(Segment {
                number: *number,
                bytes: scan.valid_bytes,
                batches: scan.batches,
            });
            newest = Some(scan);
        }

        if newest_damaged {
            tracing::error!(
                "the newest spool segment is damaged and may have hidden a sequence reservation; \
                 starting a new stream (older batches are replayed under their own)"
            );
        }
        let continued = newest.filter(|_| !newest_damaged).and_then(|scan| {
            let head = scan.head?;
            let reserved = scan.reserved_through?;
            Some((head.boot_id, reserved, scan.latest_registration))
        });
        let (stream_id, reserved_through, latest_registration) = match continued {
            Some((stream, reserved, registration)) => {
                tracing::info!(stream = %stream, next_seq = reserved + 1, segments = segments.len(),
                    pending_batches = segments.iter().map(|s| s.batches).sum::<u64>(), "spool recovered");
                (stream, reserved, registration)
            }
            None => {
                let stream = crate::identity::random_run_id();
                tracing::info!(stream = %stream, dir = %dir.display(), "starting a new spool stream");
                (stream, 0, None)
            }
        };
        Ok(Self {
            next_number: numbers.last().map_or(1, |n| n + 1),
            config,
            _lock: lock,
            stream_id,
            segments,
            active: None,
            reader: None,
            next_seq: reserved_through + 1,
            reserved_through,
            latest_registration,
            acked_in_first: 0,
            corrupt_segments,
            last_sync: Instant::now(),
            unsynced: false,
        })
    }

    fn dir(&self) -> &Path {
        &self.config.dir
    }

    /// Starts a segment headed by the latest registration and the current
    /// reservation, synced before anything is appended to it.
    fn open_segment(&mut self) -> Result<(), OutboxError> {
        let head = self
            .latest_registration
            .as_ref()
            .ok_or(OutboxError::NoRegistration)?;
        if let Some(previous) = self.active.take() {
            let path = self
                .segments
                .back()
                .map(|s| segment_path(self.dir(), s.number));
            previous
                .sync_data()
                .map_err(OutboxError::io(path.unwrap_or_default()))?;
        }
        let number = self.next_number;
        let path = segment_path(self.dir(), number);
        let mut bytes = MAGIC.to_vec();
        frame::encode(Kind::Register, &head.encode_to_vec(), &mut bytes);
        frame::encode(
            Kind::Reserve,
            &self.reserved_through.to_le_bytes(),
            &mut bytes,
        );
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(OutboxError::io(&path))?;
        self.next_number += 1;
        file.write_all(&bytes)
            .and_then(|()| file.sync_all())
            .map_err(OutboxError::io(&path))?;
        File::open(self.dir())
            .and_then(|d| d.sync_all())
            .map_err(OutboxError::io(self.dir()))?;
        self.segments.push_back(Segment {
            number,
            bytes: bytes.len() as u64,
            batches: 0,
        });
        self.active = Some(file);
        self.last_sync = Instant::now();
        self.unsynced = false;
        Ok(())
    }

    fn write_record(&mut self, kind: Kind, payload: &[u8]) -> Result<(), OutboxError> {
        let mut bytes = Vec::with_capacity(payload.len() + 16);
        frame::encode(kind, payload, &mut bytes);
        let (Some(file), Some(segment)) = (self.active.as_mut(), self.segments.back_mut()) else {
            return Err(OutboxError::NoRegistration);
        };
        let path = segment_path(&self.config.dir, segment.number);
        if let Err(source) = file.write_all(&bytes) {
            // Cut a partial write, so the next record follows a good one.
            let _ = file.set_len(segment.bytes);
            let _ = file.seek(SeekFrom::Start(segment.bytes));
            self.reader = None;
            return Err(OutboxError::Io { path, source });
        }
        segment.bytes += bytes.len() as u64;
        self.unsynced = true;
        Ok(())
    }

    fn sync(&mut self) -> Result<(), OutboxError> {
        if let (Some(file), Some(segment)) = (&self.active, self.segments.back()) {
            file.sync_data().map_err(OutboxError::io(segment_path(
                &self.config.dir,
                segment.number,
            )))?;
        }
        self.last_sync = Instant::now();
        self.unsynced = false;
        Ok(())
    }

    fn total_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.bytes).sum()
    }

    fn is_active(&self, number: u64) -> bool {
        self.active.is_some() && self.segments.back().is_some_and(|s| s.number == number)
    }

    fn remove_front(&mut self) {
        let Some(front) = self.segments.pop_front() else {
            return;
        };
        self.acked_in_first = 0;
        if self
            .reader
            .as_ref()
            .is_some_and(|r| r.number == front.number)
        {
            self.reader = None;
        }
        let path = segment_path(self.dir(), front.number);
        if let Err(error) = fs::remove_file(&path) {
            tracing::error!(path = %path.display(), %error, "cannot delete a spool segment");
        }
    }

    /// A reader positioned at `at`, reusing the open one when it is there.
    fn reader_at(&mut self, at: Position) -> Result<&mut Reader, OutboxError> {
        let open = self
            .reader
            .take()
            .filter(|r| r.number == at.segment && r.offset == at.offset);
        let reader = match open {
            Some(reader) => reader,
            None => {
                let path = segment_path(&self.config.dir, at.segment);
                let mut file = File::open(&path).map_err(OutboxError::io(&path))?;
                file.seek(SeekFrom::Start(at.offset))
                    .map_err(OutboxError::io(&path))?;
                Reader {
                    number: at.segment,
                    offset: at.offset,
                    file: BufReader::new(file),
                }
            }
        };
        Ok(self.reader.insert(reader))
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        if self.unsynced
            && let Some(file) = &self.active
        {
            let _ = file.sync_data();
        }
    }
}

fn segment_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("{number:020}.seg"))
}

fn scan_segment(path: &Path) -> std::io::Result<Scan> {
    let mut file = BufReader::new(File::open(path)?);
    let mut scan = Scan::default();
    let mut magic = [0u8; MAGIC.len()];
    if std::io::Read::read_exact(&mut file, &mut magic).is_err() {
        scan.problem = Some((String::new(), true));
        return Ok(scan);
    }
    if &magic != MAGIC {
        scan.valid_bytes = HEADER_LEN;
        scan.problem = Some(("not a spool segment (bad magic)".into(), false));
        return Ok(scan);
    }
    scan.valid_bytes = HEADER_LEN;
    loop {
        match frame::read(&mut file)? {
            Frame::End => return Ok(scan),
            Frame::Torn => {
                scan.problem = Some(("torn record".into(), true));
                return Ok(scan);
            }
            Frame::Corrupt(why) => {
                scan.problem = Some((why, false));
                return Ok(scan);
            }
            Frame::Record { kind, payload, len } => {
                match kind {
                    Kind::Register => {
                        let Ok(registration) = pb::RegisterRequest::decode(payload.as_slice())
                        else {
                            scan.problem = Some(("undecodable registration".into(), false));
                            return Ok(scan);
                        };
                        if scan.head.is_none() {
                            scan.head = Some(registration.clone());
                        }
                        scan.latest_registration = Some(registration);
                    }
                    _ if scan.head.is_none() => {
                        scan.problem = Some((
                            "the segment does not start with a registration".into(),
                            false,
                        ));
                        return Ok(scan);
                    }
                    Kind::Batch => scan.batches += 1,
                    Kind::Reserve => {
                        let Ok(bytes) = <[u8; 8]>::try_from(payload.as_slice()) else {
                            scan.problem = Some(("malformed reservation".into(), false));
                            return Ok(scan);
                        };
                        scan.reserved_through = Some(u64::from_le_bytes(bytes));
                    }
                }
                scan.valid_bytes += len;
            }
        }
    }
}

impl RecordLog for Spool {
    fn stream_id(&self) -> &str {
        &self.stream_id
    }

    fn append_register(&mut self, registration: &pb::RegisterRequest) -> Result<(), OutboxError> {
        self.latest_registration = Some(registration.clone());
        if self.active.is_none() {
            // The new segment's head is this registration.
            return self.open_segment();
        }
        self.write_record(Kind::Register, &registration.encode_to_vec())
    }

    fn append_batch(&mut self, batch: &mut pb::Batch) -> Result<(), OutboxError> {
        let full = self
            .segments
            .back()
            .is_some_and(|s| s.bytes >= self.config.segment_bytes);
        if self.active.is_none() || full {
            self.open_segment()?;
        }
        if self.next_seq > self.reserved_through {
            let reserved = self.next_seq - 1 + RESERVE_BLOCK;
            self.write_record(Kind::Reserve, &reserved.to_le_bytes())?;
            self.sync()?;
            self.reserved_through = reserved;
        }
        batch.seq = self.next_seq;
        self.write_record(Kind::Batch, &batch.encode_to_vec())?;
        self.next_seq += 1;
        if let Some(segment) = self.segments.back_mut() {
            segment.batches += 1;
        }
        if self.last_sync.elapsed() >= self.config.fsync_interval
            && let Err(error) = self.sync()
        {
            // The batch is written and will be sent; only its durability
            // against a host crash is in doubt.
            tracing::warn!(%error, "cannot sync the spool");
        }
        Ok(())
    }

    fn first(&self) -> Position {
        Position {
            segment: self.segments.front().map_or(self.next_number, |s| s.number),
            offset: HEADER_LEN,
        }
    }

    fn read(&mut self, from: Position) -> Result<Option<(Record, Position)>, OutboxError> {
        let mut at = from;
        loop {
            let Some(index) = self.segments.iter().position(|s| s.number >= at.segment) else {
                return Ok(None);
            };
            let (number, bytes) = (self.segments[index].number, self.segments[index].bytes);
            let last = index + 1 == self.segments.len();
            if number > at.segment {
                at = Position {
                    segment: number,
                    offset: HEADER_LEN,
                };
            }
            if at.offset >= bytes {
                if last {
                    return Ok(None);
                }
                at = Position {
                    segment: number + 1,
                    offset: HEADER_LEN,
                };
                continue;
            }
            let path = segment_path(&self.config.dir, number);
            let reader = self.reader_at(at)?;
            let frame = frame::read(&mut reader.file).map_err(OutboxError::io(&path))?;
            let (kind, payload) = match frame {
                Frame::Record { kind, payload, len } => {
                    at.offset += len;
                    reader.offset = at.offset;
                    (kind, payload)
                }
                Frame::End | Frame::Torn | Frame::Corrupt(_) => {
                    self.corrupt_segments += 1;
                    self.reader = None;
                    tracing::error!(path = %path.display(), offset = at.offset, frame = ?frame, "unreadable spool record; skipping the rest of the segment");
                    at.offset = bytes;
                    continue;
                }
            };
            let record = match kind {
                Kind::Reserve => continue,
                Kind::Register => {
                    pb::RegisterRequest::decode(payload.as_slice()).map(Record::Register)
                }
                Kind::Batch => pb::Batch::decode(payload.as_slice()).map(Record::Batch),
            };
            match record {
                Ok(record) => return Ok(Some((record, at))),
                Err(error) => {
                    tracing::error!(path = %path.display(), offset = at.offset, %error, "undecodable spool record; skipping it");
                }
            }
        }
    }

    fn release(&mut self, upto: Position, batch: bool) {
        while let Some(front) = self.segments.front() {
            let done = front.number < upto.segment
                || (front.number == upto.segment && upto.offset >= front.bytes);
            if !done || self.is_active(front.number) {
                break;
            }
            self.remove_front();
        }
        if batch
            && self
                .segments
                .front()
                .is_some_and(|s| s.number == upto.segment)
        {
            self.acked_in_first += 1;
        }
    }

    fn enforce_cap(&mut self) -> u64 {
        let mut lost = 0;
        while self.segments.len() > 1 && self.total_bytes() > self.config.max_bytes {
            if let Some(front) = self.segments.front() {
                let unacked = front.batches.saturating_sub(self.acked_in_first);
                tracing::warn!(
                    segment = front.number,
                    lost_batches = unacked,
                    max_bytes = self.config.max_bytes,
                    "spool full; dropping its oldest segment"
                );
                lost += unacked;
            }
            self.remove_front();
        }
        lost
    }

    fn pending_batches(&self) -> u64 {
        self.segments
            .iter()
            .map(|s| s.batches)
            .sum::<u64>()
            .saturating_sub(self.acked_in_first)
    }

    fn stats(&self) -> LogStats {
        LogStats {
            bytes: self.total_bytes(),
            segments: self.segments.len() as u64,
            corrupt_segments: self.corrupt_segments,
        }
    }
}
