//! The samples a collector holds in memory until it writes them as chunks.
//!
//! Agents keep every batch in their spools until the collector says its
//! samples are durable, so the collector need not write a sample the moment
//! it arrives: it keeps each series' samples here and writes them, a few
//! bytes each, as one compressed chunk per series at a flush. A collector
//! that dies loses only what the agents still hold; they send it again.
//!
//! Each sample carries its stream (an agent's `(node, boot)`) and batch
//! seq, so that a flush can leave out what another collector already made
//! durable (an agent that moved between collectors sent it to both), and
//! so that the stream's durable mark moves to the last batch the flush
//! holds. A batch is taken once: a replay of one already held adds nothing.
//!
//! Pure data structure: no I/O, no clock of its own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::mem::size_of;
use std::sync::Arc;

use crate::model::{AllocatorReport, GpuSampleRow, ProcessPoint};
use crate::rollup::{MINUTE_MS, bucket_start};

/// An agent's stream: its node's id and its boot (stream) id.
pub type StreamKey = (i64, String);

/// When open chunks are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLimits {
    /// The oldest sample held waits at most this long.
    pub flush_after_ms: i64,
    /// Past this many bytes of held samples, a flush is due at once.
    pub max_bytes: usize,
}

/// One sample and the batch it came in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Held<T> {
    /// Index into the holder's stream table.
    pub stream: u32,
    pub seq: u64,
    pub row: T,
}

/// Samples by series, with the streams and batches they came from.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    pub streams: Vec<StreamKey>,
    stream_index: HashMap<StreamKey, u32>,
    /// The batches held of each stream, by stream index.
    pub seqs: Vec<BTreeSet<u64>>,
    /// By device id, in arrival order.
    pub gpu: Series<GpuSampleRow>,
    /// By process id, in arrival order.
    pub processes: Series<ProcessPoint>,
    /// Allocator reports by process id, in arrival order.
    pub allocator: Series<AllocatorReport>,
    pub bytes: usize,
}

const GPU_SAMPLE_BYTES: usize = size_of::<Held<GpuSampleRow>>();
const PROCESS_SAMPLE_BYTES: usize = size_of::<Held<ProcessPoint>>();
const ALLOCATOR_REPORT_BYTES: usize = size_of::<Held<AllocatorReport>>();

impl Samples {
    fn stream(&mut self, key: &StreamKey) -> u32 {
        if let Some(&i) = self.stream_index.get(key) {
            return i;
        }
        let i = u32::try_from(self.streams.len()).unwrap_or(u32::MAX);
        self.streams.push(key.clone());
        self.seqs.push(BTreeSet::new());
        self.stream_index.insert(key.clone(), i);
        i
    }

    fn holds(&self, key: &StreamKey, seq: u64) -> bool {
        self.stream_index
            .get(key)
            .and_then(|&i| self.seqs.get(i as usize))
            .is_some_and(|seqs| seqs.contains(&seq))
    }

    fn add(&mut self, key: &StreamKey, seq: u64, batch: &HeldBatch<'_>) {
        let stream = self.stream(key);
        if let Some(seqs) = self.seqs.get_mut(stream as usize) {
            seqs.insert(seq);
        }
        hold(&mut self.gpu, batch.gpu, |r| r.device_id, stream, seq);
        hold(
            &mut self.processes,
            batch.processes,
            |r| r.process_id,
            stream,
            seq,
        );
        hold(
            &mut self.allocator,
            batch.allocator,
            |r| r.process_id,
            stream,
            seq,
        );
        self.bytes += batch.gpu.len() * GPU_SAMPLE_BYTES
            + batch.processes.len() * PROCESS_SAMPLE_BYTES
            + batch.allocator.len() * ALLOCATOR_REPORT_BYTES;
    }

    /// Moves everything of `other` in, after what is here.
    fn absorb(&mut self, other: &Samples) {
        for (i, key) in other.streams.iter().enumerate() {
            let stream = self.stream(key);
            if let (Some(seqs), Some(theirs)) =
                (self.seqs.get_mut(stream as usize), other.seqs.get(i))
            {
                seqs.extend(theirs.iter().copied());
            }
        }
        let remap = |stream: u32| -> u32 {
            other
                .streams
                .get(stream as usize)
                .and_then(|key| self.stream_index.get(key).copied())
                .unwrap_or(stream)
        };
        let gpu = remapped(&other.gpu, remap);
        let processes = remapped(&other.processes, remap);
        let allocator = remapped(&other.allocator, remap);
        extend(&mut self.gpu, gpu);
        extend(&mut self.processes, processes);
        extend(&mut self.allocator, allocator);
        self.bytes += other.bytes;
    }

    /// Leaves out every sample of a batch at or below its stream's mark in
    /// `durable` (stored by another collector); returns how many it left out.
    pub fn retain_above(&mut self, durable: &HashMap<StreamKey, u64>) -> usize {
        let marks: Vec<u64> = self
            .streams
            .iter()
            .map(|key| durable.get(key).copied().unwrap_or(0))
            .collect();
        let above = |stream: u32, seq: u64| seq > marks.get(stream as usize).copied().unwrap_or(0);
        let dropped = retain(&mut self.gpu, above)
            + retain(&mut self.processes, above)
            + retain(&mut self.allocator, above);
        for (seqs, mark) in self.seqs.iter_mut().zip(&marks) {
            seqs.retain(|s| s > mark);
        }
        dropped
    }

    /// Each stream with batches here, and the last of them: where its
    /// durable mark moves once these samples are written.
    pub fn last_seqs(&self) -> Vec<(&StreamKey, u64)> {
        self.streams
            .iter()
            .zip(&self.seqs)
            .filter_map(|(key, seqs)| Some((key, *seqs.last()?)))
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    #[cfg(test)]
    fn sample_count(&self) -> usize {
        self.gpu.values().map(Vec::len).sum::<usize>()
            + self.processes.values().map(Vec::len).sum::<usize>()
            + self.allocator.values().map(Vec::len).sum::<usize>()
    }
}

/// One batch's samples, as a writer hands them over: process samples and
/// allocator reports by their processes' row ids.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeldBatch<'a> {
    pub gpu: &'a [GpuSampleRow],
    pub processes: &'a [ProcessPoint],
    pub allocator: &'a [AllocatorReport],
}

/// Series by key, each sample with its batch.
type Series<T> = BTreeMap<i64, Vec<Held<T>>>;

fn hold<T: Copy>(series: &mut Series<T>, rows: &[T], key: fn(&T) -> i64, stream: u32, seq: u64) {
    for row in rows {
        series.entry(key(row)).or_default().push(Held {
            stream,
            seq,
            row: *row,
        });
    }
}

/// `series` with each sample's stream index turned by `remap`.
fn remapped<T: Copy>(series: &Series<T>, remap: impl Fn(u32) -> u32) -> Vec<(i64, Vec<Held<T>>)> {
    series
        .iter()
        .map(|(key, held)| {
            let held = held
                .iter()
                .map(|h| Held {
                    stream: remap(h.stream),
                    ..*h
                })
                .collect();
            (*key, held)
        })
        .collect()
}

fn extend<T>(series: &mut Series<T>, more: Vec<(i64, Vec<Held<T>>)>) {
    for (key, held) in more {
        series.entry(key).or_default().extend(held);
    }
}

/// Keeps the samples `keep` says of (stream, seq); returns how many went.
fn retain<T>(series: &mut Series<T>, keep: impl Fn(u32, u64) -> bool) -> usize {
    let mut dropped = 0;
    for held in series.values_mut() {
        let before = held.len();
        held.retain(|h| keep(h.stream, h.seq));
        dropped += before - held.len();
    }
    series.retain(|_, held| !held.is_empty());
    dropped
}

/// The open chunks of a collector: samples taken in and not yet written.
#[derive(Debug)]
pub struct OpenChunks {
    limits: ChunkLimits,
    open: Samples,
    /// Taken by a flush that has not committed yet: still read by charts,
    /// and taken again by the next flush should this one fail.
    flushing: Option<Arc<Samples>>,
    /// When the oldest sample now open arrived (the collector's clock).
    open_since_ms: Option<i64>,
    /// Each stream's durable mark as this collector last saw it.
    durable: HashMap<StreamKey, u64>,
}

impl OpenChunks {
    pub fn new(limits: ChunkLimits) -> Self {
        Self {
            limits,
            open: Samples::default(),
            flushing: None,
            open_since_ms: None,
            durable: HashMap::new(),
        }
    }

    pub fn limits(&self) -> ChunkLimits {
        self.limits
    }

    /// Takes in the samples of batch `seq` of `stream`. A batch already
    /// held, or already durable, adds nothing: returns whether it was new.
    pub fn push(
        &mut self,
        stream: &StreamKey,
        seq: u64,
        batch: &HeldBatch<'_>,
        now_ms: i64,
    ) -> bool {
        if self.durable.get(stream).is_some_and(|&d| seq <= d)
            || self.open.holds(stream, seq)
            || self.flushing.as_ref().is_some_and(|f| f.holds(stream, seq))
        {
            return false;
        }
        self.open.add(stream, seq, batch);
        self.open_since_ms.get_or_insert(now_ms);
        true
    }

    #[cfg(test)]
    fn push_rows(
        &mut self,
        stream: &StreamKey,
        seq: u64,
        gpu: &[GpuSampleRow],
        processes: &[ProcessPoint],
        now_ms: i64,
    ) -> bool {
        let batch = HeldBatch {
            gpu,
            processes,
            allocator: &[],
        };
        self.push(stream, seq, &batch, now_ms)
    }

    /// Whether a flush is due: the oldest open sample waited long enough,
    /// or the open samples fill their memory.
    pub fn due(&self, now_ms: i64) -> bool {
        self.open.bytes >= self.limits.max_bytes
            || self
                .open_since_ms
                .is_some_and(|since| now_ms - since >= self.limits.flush_after_ms)
            || self.flushing.is_some()
    }

    /// Whether held samples fill their memory twice over: flushes fail or
    /// fall behind, and new batches must wait for them.
    pub fn overfull(&self) -> bool {
        self.bytes() >= self.limits.max_bytes.saturating_mul(2)
    }

    /// Bytes of samples held, open or being flushed.
    pub fn bytes(&self) -> usize {
        self.open.bytes + self.flushing.as_ref().map_or(0, |f| f.bytes)
    }

    /// Takes every open sample for a flush (with those of a flush that
    /// failed before). `None` when there is nothing to write.
    pub fn take(&mut self) -> Option<Arc<Samples>> {
        let mut taken = match self.flushing.take() {
            Some(failed) => Arc::unwrap_or_clone(failed),
            None => Samples::default(),
        };
        taken.absorb(&std::mem::take(&mut self.open));
        self.open_since_ms = None;
        if taken.is_empty() {
            return None;
        }
        let taken = Arc::new(taken);
        self.flushing = Some(taken.clone());
        Some(taken)
    }

    /// The flush committed: its streams are durable up to `marks`.
    pub fn flushed(&mut self, marks: &[(StreamKey, u64)]) {
        self.flushing = None;
        // Only streams still sending need their mark here (it answers their
        // acks and skips their replays); an idle one's is in the database,
        // and its next session brings it back. Agents that start a stream
        // per run would otherwise grow this map for good.
        let open = &self.open;
        self.durable
            .retain(|key, _| open.stream_index.contains_key(key));
        for (key, mark) in marks {
            self.learn_durable(key, *mark);
        }
    }

    /// What the store says of a stream's durable mark (a flush of this or
    /// another collector, or a session loaded).
    pub fn learn_durable(&mut self, stream: &StreamKey, mark: u64) {
        let entry = self.durable.entry(stream.clone()).or_insert(0);
        *entry = (*entry).max(mark);
    }

    pub fn durable(&self, stream: &StreamKey) -> Option<u64> {
        self.durable.get(stream).copied()
    }

    /// Open and flushing samples of `device` in `[from_ms, to_ms]`.
    pub fn gpu_between(&self, device: i64, from_ms: i64, to_ms: i64) -> Vec<GpuSampleRow> {
        self.held_between(|s| &s.gpu, &[device], (from_ms, to_ms), |r| r.timestamp_ms)
    }

    /// Open and flushing samples of `processes` in `[from_ms, to_ms]`.
    pub fn processes_between(
        &self,
        processes: &[i64],
        from_ms: i64,
        to_ms: i64,
    ) -> Vec<ProcessPoint> {
        self.held_between(
            |s| &s.processes,
            processes,
            (from_ms, to_ms),
            |r| r.timestamp_ms,
        )
    }

    /// Open and flushing allocator reports of `processes` in `[from_ms, to_ms]`.
    pub fn allocator_between(
        &self,
        processes: &[i64],
        from_ms: i64,
        to_ms: i64,
    ) -> Vec<AllocatorReport> {
        self.held_between(
            |s| &s.allocator,
            processes,
            (from_ms, to_ms),
            |r| r.timestamp_ms,
        )
    }

    /// The samples of `keys` in one kind of `series`, open and flushing,
    /// whose time is in `[from_ms, to_ms]`.
    fn held_between<T: Copy>(
        &self,
        series: fn(&Samples) -> &Series<T>,
        keys: &[i64],
        (from_ms, to_ms): (i64, i64),
        timestamp_ms: fn(&T) -> i64,
    ) -> Vec<T> {
        self.held()
            .flat_map(|s| keys.iter().filter_map(|k| series(s).get(k)))
            .flatten()
            .map(|h| h.row)
            .filter(|r| (from_ms..=to_ms).contains(&timestamp_ms(r)))
            .collect()
    }

    fn held(&self) -> impl Iterator<Item = &Samples> {
        std::iter::once(&self.open).chain(self.flushing.as_deref())
    }
}

/// A minute of one GPU's samples, summed so that two of them (a late
/// batch's and the stored one) merge into the minute of all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuMinute {
    pub device_id: i64,
    pub minute_ms: i64,
    pub last_ts_ms: i64,
    pub samples: i64,
    pub used_min: i64,
    pub used_max: i64,
    pub used_sum: i128,
    pub used_last: i64,
    pub reserved: i64,
    pub total: i64,
    pub utilization_sum: i64,
    pub utilization_samples: i64,
    pub pcie_tx_sum: i128,
    pub pcie_tx_samples: i64,
    pub pcie_rx_sum: i128,
    pub pcie_rx_samples: i64,
}

impl GpuMinute {
    pub fn used_avg(&self) -> i64 {
        average(self.used_sum, self.samples).unwrap_or(0)
    }

    pub fn utilization(&self) -> Option<f32> {
        (self.utilization_samples > 0)
            .then(|| self.utilization_sum as f32 / self.utilization_samples as f32)
    }

    pub fn pcie_tx(&self) -> Option<i64> {
        average(self.pcie_tx_sum, self.pcie_tx_samples)
    }

    pub fn pcie_rx(&self) -> Option<i64> {
        average(self.pcie_rx_sum, self.pcie_rx_samples)
    }
}

/// A minute of one process's samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcessMinute {
    pub process_id: i64,
    pub minute_ms: i64,
    pub last_ts_ms: i64,
    pub samples: i64,
    pub used_min: i64,
    pub used_max: i64,
    pub used_sum: i128,
    pub used_last: i64,
}

impl ProcessMinute {
    pub fn used_avg(&self) -> i64 {
        average(self.used_sum, self.samples).unwrap_or(0)
    }
}

fn average(sum: i128, n: i64) -> Option<i64> {
    if n <= 0 {
        return None;
    }
    let n = i128::from(n);
    // Rounded half away from zero, as Postgres rounds a numeric.
    let rounded = if sum >= 0 {
        (sum + n / 2) / n
    } else {
        (sum - n / 2) / n
    };
    Some(i64::try_from(rounded).unwrap_or(i64::MAX))
}

/// One series' samples once per timestamp, the first to arrive: an agent
/// whose clock stepped back may send a time twice, which its chunk keeps
/// once (`flush_encoding.rs`) and its minute must count once.
fn once_per_time<T>(held: &[Held<T>], ts: impl Fn(&T) -> i64) -> Vec<&T> {
    let rising = held.windows(2).all(|w| ts(&w[0].row) < ts(&w[1].row));
    if rising {
        return held.iter().map(|h| &h.row).collect();
    }
    let mut seen = std::collections::HashSet::with_capacity(held.len());
    held.iter()
        .map(|h| &h.row)
        .filter(|r| seen.insert(ts(r)))
        .collect()
}

/// The minute rollups of `samples`, as the rollup pass computes them from
/// stored samples: min of minima, max of maxima, mean of the last values,
/// the last value, the highest reservation and capacity.
pub fn gpu_minutes(samples: &Samples) -> Vec<GpuMinute> {
    let mut minutes: BTreeMap<(i64, i64), GpuMinute> = BTreeMap::new();
    for (device, held) in &samples.gpu {
        for r in once_per_time(held, |r| r.timestamp_ms) {
            let minute_ms = bucket_start(r.timestamp_ms, MINUTE_MS);
            let m = minutes.entry((*device, minute_ms)).or_insert(GpuMinute {
                device_id: *device,
                minute_ms,
                last_ts_ms: i64::MIN,
                used_min: i64::MAX,
                used_max: i64::MIN,
                reserved: i64::MIN,
                total: i64::MIN,
                ..GpuMinute::default()
            });
            if r.timestamp_ms >= m.last_ts_ms {
                m.last_ts_ms = r.timestamp_ms;
                m.used_last = r.used_last;
            }
            m.samples += 1;
            m.used_min = m.used_min.min(r.used_min);
            m.used_max = m.used_max.max(r.used_max);
            m.used_sum += i128::from(r.used_last);
            m.reserved = m.reserved.max(r.reserved);
            m.total = m.total.max(r.total);
            if let Some(u) = r.utilization_pct {
                m.utilization_sum += i64::from(u);
                m.utilization_samples += 1;
            }
            if let Some(tx) = r.pcie_tx_bytes_per_s {
                m.pcie_tx_sum += i128::from(tx);
                m.pcie_tx_samples += 1;
            }
            if let Some(rx) = r.pcie_rx_bytes_per_s {
                m.pcie_rx_sum += i128::from(rx);
                m.pcie_rx_samples += 1;
            }
        }
    }
    minutes.into_values().collect()
}

/// The minute rollups of the process samples in `samples`.
pub fn process_minutes(samples: &Samples) -> Vec<ProcessMinute> {
    let mut minutes: BTreeMap<(i64, i64), ProcessMinute> = BTreeMap::new();
    for (process, held) in &samples.processes {
        for r in once_per_time(held, |r| r.timestamp_ms) {
            let minute_ms = bucket_start(r.timestamp_ms, MINUTE_MS);
            let m = minutes
                .entry((*process, minute_ms))
                .or_insert(ProcessMinute {
                    process_id: *process,
                    minute_ms,
                    last_ts_ms: i64::MIN,
                    used_min: i64::MAX,
                    used_max: i64::MIN,
                    ..ProcessMinute::default()
                });
            if r.timestamp_ms >= m.last_ts_ms {
                m.last_ts_ms = r.timestamp_ms;
                m.used_last = r.used_last;
            }
            m.samples += 1;
            m.used_min = m.used_min.min(r.used_last);
            m.used_max = m.used_max.max(r.used_max);
            m.used_sum += i128::from(r.used_last);
        }
    }
    minutes.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ChunkLimits = ChunkLimits {
        flush_after_ms: 60_000,
        max_bytes: 1 << 20,
    };

    fn stream(boot: &str) -> StreamKey {
        (1, boot.to_owned())
    }

    fn gpu(device: i64, ts: i64, used: i64) -> GpuSampleRow {
        GpuSampleRow {
            device_id: device,
            timestamp_ms: ts,
            interval_ms: 1000,
            poll_count: 10,
            used_last: used,
            used_min: used - 1,
            used_max: used + 1,
            reserved: 5,
            total: 100,
            utilization_pct: Some(50),
            pcie_tx_bytes_per_s: None,
            pcie_rx_bytes_per_s: Some(7),
        }
    }

    fn process(id: i64, ts: i64, used: i64) -> ProcessPoint {
        ProcessPoint {
            process_id: id,
            timestamp_ms: ts,
            used_last: used,
            used_max: used,
        }
    }

    #[test]
    fn a_batch_is_held_once_however_often_it_is_replayed() {
        let mut open = OpenChunks::new(LIMITS);
        let s = stream("a");
        assert!(open.push_rows(&s, 1, &[gpu(7, 1_000, 10)], &[], 0));
        assert!(!open.push_rows(&s, 1, &[gpu(7, 1_000, 10)], &[], 0));
        let taken = open.take().expect("samples");
        assert_eq!(taken.sample_count(), 1);
        // While the flush is in flight, a replay of it is still known.
        assert!(!open.push_rows(&s, 1, &[gpu(7, 1_000, 10)], &[], 0));
        open.flushed(&[(s.clone(), 1)]);
        // Once durable, a replay is known by the mark.
        assert!(!open.push_rows(&s, 1, &[gpu(7, 1_000, 10)], &[], 0));
        assert!(open.push_rows(&s, 2, &[gpu(7, 2_000, 10)], &[], 0));
    }

    #[test]
    fn an_idle_streams_mark_is_forgotten_and_a_busy_ones_kept() {
        let mut open = OpenChunks::new(LIMITS);
        let (idle, busy) = (stream("idle"), stream("busy"));
        open.push_rows(&idle, 4, &[gpu(7, 1_000, 10)], &[], 0);
        open.push_rows(&busy, 8, &[gpu(8, 1_000, 10)], &[], 0);
        open.take();
        open.flushed(&[(idle.clone(), 4), (busy.clone(), 8)]);
        open.push_rows(&busy, 9, &[gpu(8, 2_000, 10)], &[], 0);
        open.take();
        open.flushed(&[(busy.clone(), 9)]);
        assert_eq!(open.durable(&busy), Some(9));
        assert_eq!(open.durable(&idle), None, "idle through a whole flush");
    }

    #[test]
    fn a_flush_is_due_by_age_or_by_memory() {
        let mut open = OpenChunks::new(ChunkLimits {
            flush_after_ms: 60_000,
            max_bytes: 3 * GPU_SAMPLE_BYTES,
        });
        let s = stream("a");
        assert!(!open.due(0));
        open.push_rows(&s, 1, &[gpu(7, 1_000, 10)], &[], 5_000);
        assert!(!open.due(64_999));
        assert!(open.due(65_000));
        open.push_rows(&s, 2, &[gpu(7, 2_000, 10), gpu(8, 2_000, 10)], &[], 5_000);
        assert!(open.due(5_000), "three samples fill the cap");
        assert_eq!(open.bytes(), 3 * GPU_SAMPLE_BYTES);
    }

    #[test]
    fn a_failed_flush_is_taken_again_with_what_arrived_since() {
        let mut open = OpenChunks::new(LIMITS);
        let (a, b) = (stream("a"), stream("b"));
        open.push_rows(&a, 1, &[gpu(7, 1_000, 10)], &[process(3, 1_000, 4)], 0);
        let first = open.take().expect("samples");
        assert_eq!(first.sample_count(), 2);
        open.push_rows(&b, 9, &[gpu(8, 1_500, 10)], &[], 0);
        open.push_rows(&a, 2, &[gpu(7, 2_000, 11)], &[], 0);
        // Both the failed flush's samples and the new ones chart meanwhile.
        assert_eq!(open.gpu_between(7, 0, 10_000).len(), 2);
        assert!(open.due(0), "a failed flush is due again at once");
        let again = open.take().expect("samples");
        assert_eq!(again.sample_count(), 4);
        let mut marks: Vec<(String, u64)> = again
            .last_seqs()
            .into_iter()
            .map(|(k, s)| (k.1.clone(), s))
            .collect();
        marks.sort();
        assert_eq!(marks, [("a".to_owned(), 2), ("b".to_owned(), 9)]);
        assert_eq!(
            again.gpu[&7].iter().map(|h| h.seq).collect::<Vec<_>>(),
            [1, 2]
        );
    }

    #[test]
    fn what_another_collector_made_durable_is_left_out() {
        let mut open = OpenChunks::new(LIMITS);
        let s = stream("a");
        for seq in 10..=15 {
            open.push_rows(
                &s,
                seq,
                &[gpu(7, seq as i64 * 1_000, 10)],
                &[process(3, seq as i64 * 1_000, 1)],
                0,
            );
        }
        let mut taken = Arc::unwrap_or_clone(open.take().expect("samples"));
        let durable = HashMap::from([(s.clone(), 12)]);
        assert_eq!(taken.retain_above(&durable), 6);
        assert_eq!(taken.gpu[&7].len(), 3);
        assert_eq!(taken.processes[&3].len(), 3);
        assert_eq!(taken.last_seqs(), [(&s, 15)]);
        let all = HashMap::from([(s.clone(), 15)]);
        taken.retain_above(&all);
        assert!(taken.gpu.is_empty() && taken.last_seqs().is_empty());
    }

    #[test]
    fn minute_rollups_match_the_rollup_pass_and_merge_late_samples() {
        let mut open = OpenChunks::new(LIMITS);
        let s = stream("a");
        open.push_rows(&s, 1, &[gpu(7, 60_000, 10), gpu(7, 61_000, 20)], &[], 0);
        // Late, and older than what came before: the last value is still
        // the newest sample's.
        open.push_rows(
            &s,
            2,
            &[gpu(7, 59_000, 40), gpu(7, 120_000, 1)],
            &[process(3, 60_500, 8), process(3, 61_500, 2)],
            0,
        );
        let taken = open.take().expect("samples");
        let minutes = gpu_minutes(&taken);
        assert_eq!(minutes.len(), 3);
        let m = minutes[1];
        assert_eq!((m.device_id, m.minute_ms, m.samples), (7, 60_000, 2));
        assert_eq!(
            (m.used_min, m.used_max, m.used_avg(), m.used_last),
            (9, 21, 15, 20)
        );
        assert_eq!(m.last_ts_ms, 61_000);
        assert_eq!(m.utilization(), Some(50.0));
        assert_eq!((m.pcie_tx(), m.pcie_rx()), (None, Some(7)));
        let p = process_minutes(&taken);
        assert_eq!(p.len(), 1);
        assert_eq!(
            (
                p[0].used_min,
                p[0].used_max,
                p[0].used_avg(),
                p[0].used_last
            ),
            (2, 8, 5, 2)
        );
    }

    #[test]
    fn a_time_sent_twice_counts_once_in_its_minute() {
        let mut open = OpenChunks::new(LIMITS);
        let s = stream("a");
        open.push_rows(&s, 1, &[gpu(7, 60_000, 10), gpu(7, 61_000, 20)], &[], 0);
        // The agent's clock stepped back a second: 61 s again, another value.
        open.push_rows(
            &s,
            2,
            &[gpu(7, 61_000, 90), gpu(7, 62_000, 30)],
            &[process(3, 60_500, 8), process(3, 60_500, 4)],
            0,
        );
        let taken = open.take().expect("samples");
        let m = gpu_minutes(&taken)[0];
        assert_eq!(m.samples, 3, "the repeated second once");
        assert_eq!((m.used_avg(), m.used_max), (20, 31), "the first to arrive");
        let p = process_minutes(&taken)[0];
        assert_eq!((p.samples, p.used_last), (1, 8));
    }

    #[test]
    fn averages_round_half_away_from_zero() {
        assert_eq!(average(5, 2), Some(3));
        assert_eq!(average(-5, 2), Some(-3));
        assert_eq!(average(4, 3), Some(1));
        assert_eq!(average(1, 0), None);
    }
}
