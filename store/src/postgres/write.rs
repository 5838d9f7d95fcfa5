//! Writing a group of batches, from any number of agents, in one
//! transaction: the process and allocator rows and events, then one
//! statement for everything else (the agent boots' committed seqs, the
//! nodes' last-seen times, the `gpu_latest` checkpoints, process refreshes,
//! late minutes' marks). Each statement costs a round trip, and under load
//! a round trip costs a millisecond or more of waiting. The samples go to
//! the open chunks once the transaction commits (`open_chunks.rs`), or,
//! where samples are written as rows, in one binary `COPY` per sample
//! table inside it.
//!
//! Exactly once: the write first locks the agent boots of its batches (in
//! key order) and reads their committed seqs; a batch whose seq was already
//! committed is left out and reported as a duplicate (or, its samples not
//! yet durable, replayed: only its samples are taken), inside the same
//! transaction that writes the others, so two collectors can never both
//! accept one batch. Every other row a write touches (nodes, devices'
//! checkpoints, processes) belongs to one of those boots' nodes, so two
//! writes that could meet on them meet on the boots first, and queue there.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use sqlx::postgres::PgConnection;
use sqlx::{Connection, Postgres, Row, Transaction};

use super::checkpoints::{
    AllocatorSeen, AllocatorSeenCache, LatestCache, NodeCache, NodeSeen, ProcessSeen,
    ProcessSeenCache, newest_per_key,
};
use super::copy::{BinaryRows, copy_in};
use super::process_cache::{ProcessCache, ProcessKey, RowState};
use crate::StoreError;
use crate::model::{
    AllocatorRow, EventRow, GpuSampleRow, ProcessPoint, ProcessSampleRow, StoreBatch, WriteOutcome,
};
use crate::open_chunks::{HeldBatch, OpenChunks};
use crate::rollup::{MINUTE_MS, minutes_of};

/// Writes `batches` in one transaction; one outcome per batch, in order.
pub(super) async fn write_group(
    conn: &mut PgConnection,
    caches: &Caches<'_>,
    batches: &[StoreBatch],
) -> Result<Vec<WriteOutcome>, StoreError> {
    let mut tx = conn.begin().await?;
    let claimed = claim_seqs(&mut tx, batches, caches.chunks.is_some()).await?;
    if claimed.accepted.is_empty() && claimed.replayed.is_empty() {
        tx.rollback().await?;
        return Ok(claimed.outcomes);
    }
    write_claimed(tx, caches, &claimed).await?;
    Ok(claimed.outcomes)
}

/// What a write knows of the rows it keeps up to date, and when it is.
#[derive(Debug)]
pub(super) struct Caches<'c> {
    pub(super) process: &'c ProcessCache,
    pub(super) latest: &'c LatestCache,
    pub(super) nodes: &'c NodeCache,
    pub(super) process_seen: &'c ProcessSeenCache,
    pub(super) allocator_seen: &'c AllocatorSeenCache,
    /// Where samples go when they are written as chunks at a flush; `None`
    /// where they are written as rows.
    pub(super) chunks: Option<&'c Mutex<OpenChunks>>,
    /// The wall clock, which paces the checkpoints.
    pub(super) now_ms: i64,
    /// This collector's id in `gpu_latest.writer`.
    pub(super) writer: i64,
}

/// Writes the accepted batches of `claim` and commits.
async fn write_claimed(
    mut tx: Transaction<'_, Postgres>,
    caches: &Caches<'_>,
    claim: &Claim<'_>,
) -> Result<(), StoreError> {
    let chunked = caches.chunks.is_some();
    let gpu: Vec<&GpuSampleRow> = claim.accepted.iter().flat_map(|b| &b.gpu_samples).collect();
    let processes: Vec<&ProcessSampleRow> = claim
        .accepted
        .iter()
        .flat_map(|b| &b.process_samples)
        .collect();
    let events: Vec<(i64, &EventRow)> = claim
        .accepted
        .iter()
        .flat_map(|b| b.events.iter().map(|e| (b.node_id, e)))
        .collect();
    if !chunked && !gpu.is_empty() {
        copy_in(
            &mut tx,
            GPU_SAMPLES_COPY,
            gpu_sample_rows(gpu.iter().copied())?,
        )
        .await?;
    }
    // One sample per device: ON CONFLICT may touch a row once per statement.
    let newest = newest_per_key(&gpu);
    let latest = caches.latest.due(&newest, caches.now_ms);
    let seen = newest_per_node(&claim.accepted);
    let seen_newest: Vec<&NodeSeen> = seen.iter().collect();
    let nodes = caches.nodes.due(&seen_newest, caches.now_ms);
    // A replayed batch's processes have rows; their ids come the same way.
    let with_replayed: Vec<&ProcessSampleRow> = processes
        .iter()
        .copied()
        .chain(claim.replayed.iter().flat_map(|b| &b.process_samples))
        .collect();
    let processes_written = write_process_samples(&mut tx, caches.process, &with_replayed).await?;
    if !chunked && !processes_written.committed.is_empty() {
        let copy = process_sample_rows(
            processes_written
                .committed
                .iter()
                .map(|(id, row)| (*id, row.timestamp_ms, row.used_last, row.used_max)),
        );
        copy_in(&mut tx, PROCESS_SAMPLES_COPY, copy).await?;
    }
    if !chunked {
        write_allocator_rows(&mut tx, &processes).await?;
    }
    let reports = newest_allocator_reports(&processes_written.committed);
    let report_refs: Vec<&AllocatorSeen> = reports.iter().collect();
    let checkpointed = pair_checkpoints(
        process_refreshes(caches, &processes_written),
        caches.allocator_seen.due(&report_refs, caches.now_ms),
        &reports,
        &processes_written,
    );
    write_allocator_checkpoints(&mut tx, &checkpointed.reports).await?;
    write_events(&mut tx, &events).await?;
    // Chunks are rolled up as they are written, late ones too.
    let minutes = if chunked {
        Vec::new()
    } else {
        minutes_of(
            gpu.iter()
                .map(|s| s.timestamp_ms)
                .chain(processes.iter().map(|s| s.timestamp_ms)),
        )
    };
    let moved = keep_books(
        &mut tx,
        &Books {
            boots: &claim.boots,
            durable_at_commit: !chunked,
            nodes: &nodes,
            latest: &latest,
            refreshed: &checkpointed.seen_alone,
            minutes,
            writer: caches.writer,
        },
    )
    .await?;
    if moved != claim.boots.len() {
        // The boots' rows are locked since the claim read them.
        return Err(StoreError::Invalid(format!(
            "{} of {} agent boots' committed seqs moved under their row locks",
            claim.boots.len() - moved.min(claim.boots.len()),
            claim.boots.len()
        )));
    }
    tx.commit().await?;
    caches.process.learn(&processes_written.committed);
    let mut seen = processes_written.steady;
    seen.extend_from_slice(&processes_written.upserted);
    let seen_refs: Vec<&ProcessSeen> = seen.iter().collect();
    let mut written = checkpointed.seen_alone;
    written.extend(checkpointed.reports.iter().filter_map(|(_, seen)| *seen));
    written.extend_from_slice(&processes_written.upserted);
    let reports_written: Vec<AllocatorSeen> = checkpointed
        .reports
        .iter()
        .map(|(report, _)| *report)
        .collect();
    caches
        .process_seen
        .learn(&newest_per_key(&seen_refs), &written, caches.now_ms);
    caches.latest.learn(&newest, &latest, caches.now_ms);
    caches.nodes.learn(&seen_newest, &nodes, caches.now_ms);
    caches
        .allocator_seen
        .learn(&report_refs, &reports_written, caches.now_ms);
    if let Some(chunks) = caches.chunks {
        hold_samples(chunks, claim, &processes_written.committed, caches.now_ms);
    }
    Ok(())
}

/// Puts the samples of the batches `claim` stored (and replayed) into the
/// open chunks, each process sample by its row's id, once they are
/// committed: a failed write leaves the agent to send the batch again.
fn hold_samples(
    chunks: &Mutex<OpenChunks>,
    claim: &Claim<'_>,
    process_ids: &[(i64, &ProcessSampleRow)],
    now_ms: i64,
) {
    let ids: HashMap<ProcessKey, i64> = process_ids
        .iter()
        .map(|(id, row)| (ProcessKey::of(row), *id))
        .collect();
    let mut open = chunks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for batch in claim.accepted.iter().chain(&claim.replayed) {
        let mut points = Vec::with_capacity(batch.process_samples.len());
        let mut reports = Vec::new();
        for row in &batch.process_samples {
            let Some(&process_id) = ids.get(&ProcessKey::of(row)) else {
                continue;
            };
            points.push(ProcessPoint {
                process_id,
                timestamp_ms: row.timestamp_ms,
                used_last: row.used_last,
                used_max: row.used_max,
            });
            reports.extend(row.allocator.map(|a| a.report(process_id)));
        }
        let held = HeldBatch {
            gpu: &batch.gpu_samples,
            processes: &points,
            allocator: &reports,
        };
        open.push(
            &(batch.node_id, batch.boot_id.clone()),
            batch.seq,
            &held,
            now_ms,
        );
    }
}

/// Which batches of a group a write stores, and what that does to each
/// agent boot's committed seq.
struct Claim<'b> {
    /// One per batch of the group, in order.
    outcomes: Vec<WriteOutcome>,
    accepted: Vec<&'b StoreBatch>,
    /// Accepted before, their samples not yet durable: only their samples
    /// are taken (into open chunks).
    replayed: Vec<&'b StoreBatch>,
    /// Boots with accepted batches, in key order: each boot's committed seq
    /// is below `first_seq` and moves to `last_seq`.
    boots: Vec<BootMove<'b>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BootMove<'b> {
    node_id: i64,
    boot_id: &'b str,
    first_seq: i64,
    last_seq: i64,
}

impl<'b> Claim<'b> {
    /// The claim from each boot's committed and durable seqs. A batch is
    /// new when its seq is above its boot's committed seq and above every
    /// seq already accepted for the boot in this group: a replay inside the
    /// group, or of a committed batch, is left out, and so is a batch of a
    /// boot with no row (never registered), as a duplicate of nothing.
    /// Where samples go to open chunks (`chunked`), a replay of a batch
    /// committed but not yet durable is replayed: its samples are taken
    /// again.
    fn with_seqs(
        batches: &'b [StoreBatch],
        seqs: &HashMap<(i64, &str), BootSeqs>,
        chunked: bool,
    ) -> Self {
        let mut outcomes = Vec::with_capacity(batches.len());
        let mut accepted = Vec::with_capacity(batches.len());
        let mut replayed = Vec::new();
        let mut moves: BTreeMap<(i64, &'b str), BootMove<'b>> = BTreeMap::new();
        for batch in batches {
            let seq = i64::try_from(batch.seq).unwrap_or(i64::MAX);
            let key = (batch.node_id, batch.boot_id.as_str());
            let stored = seqs.get(&key);
            let current = moves
                .get(&key)
                .map(|m| m.last_seq)
                .or_else(|| stored.map(|s| s.committed));
            match (current, stored) {
                (Some(current), _) if current < seq => {}
                (_, Some(stored)) if chunked && stored.durable < seq && seq <= stored.committed => {
                    outcomes.push(WriteOutcome::Replayed);
                    replayed.push(batch);
                    continue;
                }
                // A replay of a batch accepted before and durable, or of one
                // this group accepts: in open chunks, only the durable mark
                // may be acknowledged.
                _ => {
                    let reported = if chunked {
                        stored.map(|s| s.durable)
                    } else {
                        current
                    };
                    outcomes.push(WriteOutcome::Duplicate {
                        committed_seq: reported.and_then(|c| u64::try_from(c).ok()).unwrap_or(0),
                    });
                    continue;
                }
            }
            outcomes.push(WriteOutcome::Committed);
            accepted.push(batch);
            moves
                .entry(key)
                .and_modify(|m| m.last_seq = seq)
                .or_insert(BootMove {
                    node_id: batch.node_id,
                    boot_id: key.1,
                    first_seq: seq,
                    last_seq: seq,
                });
        }
        Self {
            outcomes,
            accepted,
            replayed,
            // In key order, as the claim locked them.
            boots: moves.into_values().collect(),
        }
    }
}

/// Locks the boots of `batches` (in key order, so two collectors writing
/// overlapping groups cannot deadlock) and decides which batches are new
/// from their committed seqs. (The `= ANY` lets Postgres find the rows by
/// index: the planned join would scan the whole table, whose rows each
/// write updates.)
async fn claim_seqs<'b>(
    tx: &mut Transaction<'_, Postgres>,
    batches: &'b [StoreBatch],
    chunked: bool,
) -> Result<Claim<'b>, StoreError> {
    let nodes: Vec<i64> = batches.iter().map(|b| b.node_id).collect();
    let boots: Vec<&str> = batches.iter().map(|b| b.boot_id.as_str()).collect();
    let rows = sqlx::query(
        "SELECT b.node_id, b.boot_id, b.committed_seq, COALESCE(d.durable_seq, 0) AS durable_seq
         FROM agent_boots b JOIN (SELECT DISTINCT * FROM UNNEST($1::int8[], $2::text[])) AS k(node_id, boot_id)
             ON b.node_id = k.node_id AND b.boot_id = k.boot_id
         LEFT JOIN stream_durable d ON d.node_id = b.node_id AND d.boot_id = b.boot_id
         WHERE b.node_id = ANY($1)
         ORDER BY b.node_id, b.boot_id
         FOR UPDATE OF b",
    )
    .bind(&nodes)
    .bind(&boots)
    .fetch_all(&mut **tx)
    .await?;
    let mut seqs: HashMap<(i64, &str), BootSeqs> = HashMap::with_capacity(rows.len());
    for row in &rows {
        seqs.insert(
            (row.try_get("node_id")?, row.try_get("boot_id")?),
            BootSeqs {
                committed: row.try_get("committed_seq")?,
                durable: row.try_get("durable_seq")?,
            },
        );
    }
    Ok(Claim::with_seqs(batches, &seqs, chunked))
}

/// An agent boot's marks: the last batch accepted, and the last whose
/// samples are durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BootSeqs {
    committed: i64,
    durable: i64,
}

/// The steady processes whose last-seen checkpoint is due: not those
/// whose whole row this write upserts anyway.
fn process_refreshes(caches: &Caches<'_>, written: &ProcessesWritten<'_>) -> Vec<ProcessSeen> {
    let upserted: HashSet<i64> = written.upserted.iter().map(|u| u.process_id).collect();
    let steady: Vec<&ProcessSeen> = written
        .steady
        .iter()
        .filter(|s| !upserted.contains(&s.process_id))
        .collect();
    let mut due = caches.process_seen.due(&steady, caches.now_ms);
    due.retain(|s| !upserted.contains(&s.process_id));
    due
}

/// The process checkpoints a write makes, a row version each.
#[derive(Debug, Default, PartialEq)]
struct ProcessCheckpoints {
    /// Memory and last-seen times written alone, in id order.
    seen_alone: Vec<ProcessSeen>,
    /// Newest allocator reports, each with its process's memory and
    /// last-seen time where this write has them, in id order.
    reports: Vec<(AllocatorSeen, Option<ProcessSeen>)>,
}

/// Pairs the checkpoints due: a reporting process whose memory or report
/// is due gets both written, in one row version (the two keep the same
/// pace, so they would otherwise fall due together and make two). Writing
/// a value earlier than due is always right: it is the newest committed.
fn pair_checkpoints(
    seen_due: Vec<ProcessSeen>,
    reports_due: Vec<AllocatorSeen>,
    reports: &[AllocatorSeen],
    written: &ProcessesWritten<'_>,
) -> ProcessCheckpoints {
    let upserted: HashSet<i64> = written.upserted.iter().map(|u| u.process_id).collect();
    let steady: HashMap<i64, ProcessSeen> = written
        .steady
        .iter()
        .filter(|s| !upserted.contains(&s.process_id))
        .map(|s| (s.process_id, *s))
        .collect();
    let report_of: HashMap<i64, AllocatorSeen> =
        reports.iter().map(|r| (r.process_id, *r)).collect();
    let mut paired: BTreeMap<i64, (AllocatorSeen, Option<ProcessSeen>)> = reports_due
        .into_iter()
        .map(|r| (r.process_id, (r, steady.get(&r.process_id).copied())))
        .collect();
    let mut seen_alone = Vec::new();
    for seen in seen_due {
        if let Some((_, with)) = paired.get_mut(&seen.process_id) {
            *with = Some(seen);
        } else if let Some(report) = report_of.get(&seen.process_id) {
            paired.insert(seen.process_id, (*report, Some(seen)));
        } else {
            seen_alone.push(seen);
        }
    }
    ProcessCheckpoints {
        seen_alone,
        reports: paired.into_values().collect(),
    }
}

/// Each node's newest sample time in `batches`, in node order.
fn newest_per_node(batches: &[&StoreBatch]) -> Vec<NodeSeen> {
    let mut newest: BTreeMap<i64, i64> = BTreeMap::new();
    for batch in batches {
        if let Some(ts) = batch.newest_timestamp_ms() {
            let entry = newest.entry(batch.node_id).or_insert(ts);
            *entry = (*entry).max(ts);
        }
    }
    newest
        .into_iter()
        .map(|(node_id, timestamp_ms)| NodeSeen {
            node_id,
            timestamp_ms,
        })
        .collect()
}

/// Everything a write moves besides the rows it inserts.
#[derive(Debug, Default)]
struct Books<'a> {
    boots: &'a [BootMove<'a>],
    /// Whether the boots' samples are durable as this write commits (rows),
    /// or only once a flush writes their chunks.
    durable_at_commit: bool,
    /// Nodes' last-seen times due, in node order.
    nodes: &'a [NodeSeen],
    /// `gpu_latest` rows due, one per device, in device order.
    latest: &'a [GpuSampleRow],
    /// Steady processes' last-seen times and memory due, in id order.
    refreshed: &'a [ProcessSeen],
    /// The distinct minutes of the samples; those before the minute
    /// rollup's watermark are marked for the rollup job to redo.
    minutes: Vec<i64>,
    /// The collector writing, as `gpu_latest.writer` records it.
    writer: i64,
}

/// One statement for all of `books`; returns how many boots' seqs moved
/// (each moves only if its committed seq is below the write's first, which
/// the claim made sure of).
///
/// The late minutes are found against the watermark read under a share
/// lock held to commit: the rollup job cannot move the watermark past a
/// minute of these rows without waiting for this transaction, so every row
/// is either before the watermark and marked here, or after it and rolled
/// up later. The marks are plain inserts (they may repeat) and wait for
/// nothing: the job takes only marks committed before it looked.
async fn keep_books(conn: &mut PgConnection, books: &Books<'_>) -> Result<usize, StoreError> {
    let latest = books.latest;
    let moved: i64 = sqlx::query_scalar(
        "WITH moved AS (
             UPDATE agent_boots b SET committed_seq = v.last_seq
             FROM UNNEST($1::int8[], $2::text[], $3::int8[], $4::int8[]) AS v(node_id, boot_id, first_seq, last_seq)
             WHERE b.node_id = ANY($1) AND b.node_id = v.node_id AND b.boot_id = v.boot_id
                 AND b.committed_seq < v.first_seq
             RETURNING b.node_id, b.boot_id, v.last_seq),
         durable AS (
             INSERT INTO stream_durable (node_id, boot_id, durable_seq)
             SELECT node_id, boot_id, last_seq FROM moved WHERE $22
             ON CONFLICT (node_id, boot_id) DO UPDATE
                 SET durable_seq = GREATEST(stream_durable.durable_seq, EXCLUDED.durable_seq)),
         touched AS (
             UPDATE nodes n SET last_seen_ms = GREATEST(n.last_seen_ms, v.ts)
             FROM UNNEST($5::int8[], $6::int8[]) AS v(id, ts) WHERE n.id = ANY($5) AND n.id = v.id),
         latest AS (
             INSERT INTO gpu_latest (device_id, ts_ms, used_last, used_min, used_max, reserved, total, utilization, pcie_tx, pcie_rx, writer)
             SELECT u.*, $23 FROM UNNEST($7::int4[], $8::int8[], $9::int8[], $10::int8[], $11::int8[], $12::int8[],
                 $13::int8[], $14::int2[], $15::int8[], $16::int8[]) AS u
             ON CONFLICT (device_id) DO UPDATE SET ts_ms = EXCLUDED.ts_ms, used_last = EXCLUDED.used_last,
                 used_min = EXCLUDED.used_min, used_max = EXCLUDED.used_max, reserved = EXCLUDED.reserved,
                 total = EXCLUDED.total, utilization = EXCLUDED.utilization, pcie_tx = EXCLUDED.pcie_tx,
                 pcie_rx = EXCLUDED.pcie_rx, writer = EXCLUDED.writer
             WHERE gpu_latest.ts_ms <= EXCLUDED.ts_ms),
         refreshed AS (
             UPDATE processes p SET
                 memory_last = CASE WHEN v.ts >= p.last_seen_ms THEN v.last ELSE p.memory_last END,
                 last_seen_ms = GREATEST(p.last_seen_ms, v.ts)
             FROM UNNEST($17::int8[], $18::int8[], $19::int8[]) AS v(id, ts, last) WHERE p.id = ANY($17) AND p.id = v.id),
         marked AS (
             INSERT INTO rollup_pending (step_ms, bucket_ms)
             SELECT $20, m FROM UNNEST($21::int8[]) AS m
             WHERE m < (SELECT done_until_ms FROM rollup_progress WHERE step_ms = $20 FOR SHARE))
         SELECT count(*) FROM moved",
    )
    .bind(books.boots.iter().map(|m| m.node_id).collect::<Vec<_>>())
    .bind(books.boots.iter().map(|m| m.boot_id).collect::<Vec<_>>())
    .bind(books.boots.iter().map(|m| m.first_seq).collect::<Vec<_>>())
    .bind(books.boots.iter().map(|m| m.last_seq).collect::<Vec<_>>())
    .bind(books.nodes.iter().map(|n| n.node_id).collect::<Vec<_>>())
    .bind(books.nodes.iter().map(|n| n.timestamp_ms).collect::<Vec<_>>())
    .bind(device_ids(latest.iter().map(|r| r.device_id))?)
    .bind(latest.iter().map(|r| r.timestamp_ms).collect::<Vec<_>>())
    .bind(latest.iter().map(|r| r.used_last).collect::<Vec<_>>())
    .bind(latest.iter().map(|r| r.used_min).collect::<Vec<_>>())
    .bind(latest.iter().map(|r| r.used_max).collect::<Vec<_>>())
    .bind(latest.iter().map(|r| r.reserved).collect::<Vec<_>>())
    .bind(latest.iter().map(|r| r.total).collect::<Vec<_>>())
    .bind(latest.iter().map(|r| r.utilization_pct).collect::<Vec<_>>())
    .bind(latest.iter().map(|r| r.pcie_tx_bytes_per_s).collect::<Vec<_>>())
    .bind(latest.iter().map(|r| r.pcie_rx_bytes_per_s).collect::<Vec<_>>())
    .bind(books.refreshed.iter().map(|r| r.process_id).collect::<Vec<_>>())
    .bind(books.refreshed.iter().map(|r| r.timestamp_ms).collect::<Vec<_>>())
    .bind(books.refreshed.iter().map(|r| r.memory).collect::<Vec<_>>())
    .bind(MINUTE_MS)
    .bind(&books.minutes)
    .bind(books.durable_at_commit)
    .bind(books.writer)
    .fetch_one(conn)
    .await?;
    Ok(usize::try_from(moved).unwrap_or(0))
}

pub(super) const GPU_SAMPLES_COPY: &str = "COPY gpu_samples (ts_ms, used_last, used_min, used_max,
    reserved, total, pcie_tx, pcie_rx, device_id, interval_ms, poll_count, utilization)
    FROM STDIN (FORMAT binary)";

/// Raw GPU samples as rows for [`GPU_SAMPLES_COPY`].
pub(super) fn gpu_sample_rows<'r>(
    s: impl ExactSizeIterator<Item = &'r GpuSampleRow>,
) -> Result<BinaryRows, StoreError> {
    let mut rows = BinaryRows::new(12, s.len());
    for r in s {
        rows.row()
            .int8(r.timestamp_ms)
            .int8(r.used_last)
            .int8(r.used_min)
            .int8(r.used_max)
            .int8(r.reserved)
            .int8(r.total)
            .opt_int8(r.pcie_tx_bytes_per_s)
            .opt_int8(r.pcie_rx_bytes_per_s)
            .int4(device_id(r.device_id)?)
            .int4(r.interval_ms)
            .int4(r.poll_count)
            .opt_int2(r.utilization_pct);
    }
    Ok(rows)
}

pub(super) const PROCESS_SAMPLES_COPY: &str =
    "COPY process_samples (process_id, ts_ms, used_last, used_max) FROM STDIN (FORMAT binary)";

/// Process samples, by process id, as rows for [`PROCESS_SAMPLES_COPY`].
pub(super) fn process_sample_rows(
    s: impl ExactSizeIterator<Item = (i64, i64, i64, i64)>,
) -> BinaryRows {
    let mut rows = BinaryRows::new(4, s.len());
    for (process_id, ts_ms, used_last, used_max) in s {
        rows.row()
            .int8(process_id)
            .int8(ts_ms)
            .int8(used_last)
            .int8(used_max);
    }
    rows
}

/// Moves each device's row in `gpu_latest` (what the fleet overview reads)
/// to its sample in `latest` (one per device), each node's last-seen time
/// to `nodes` and each process's to `processes`, unless a newer one is
/// already there.
pub(super) async fn write_checkpoints(
    conn: &mut PgConnection,
    writer: i64,
    latest: &[GpuSampleRow],
    nodes: &[NodeSeen],
    processes: &[ProcessSeen],
) -> Result<(), StoreError> {
    if !latest.is_empty() || !nodes.is_empty() || !processes.is_empty() {
        keep_books(
            conn,
            &Books {
                latest,
                nodes,
                refreshed: processes,
                writer,
                ..Books::default()
            },
        )
        .await?;
    }
    Ok(())
}

/// What a write did to the rows of `processes`.
#[derive(Debug, Default)]
struct ProcessesWritten<'r> {
    /// Every sample stored, with its row id, for the process cache to learn
    /// once the transaction commits.
    committed: Vec<(i64, &'r ProcessSampleRow)>,
    /// Each steady process's newest sample: its row's last-seen checkpoint.
    steady: Vec<ProcessSeen>,
    /// Each upserted process's newest sample, which its row now holds.
    upserted: Vec<ProcessSeen>,
}

/// The rows of the processes of samples `p`, with each sample's row id. A
/// process this collector wrote recently and that has not changed (most,
/// between allocator growth steps) keeps its row, but for its last-seen
/// time and memory, a checkpoint (left to [`keep_books`]); its samples go
/// in by the id the cache knows. The others are upserted, which returns
/// their ids.
async fn write_process_samples<'r>(
    tx: &mut Transaction<'_, Postgres>,
    cache: &ProcessCache,
    p: &[&'r ProcessSampleRow],
) -> Result<ProcessesWritten<'r>, StoreError> {
    if p.is_empty() {
        return Ok(ProcessesWritten::default());
    }
    let states = cache.states(p);
    // A process upserted for one sample is upserted from all of them: the
    // row then takes the newest sample's memory, not an older peak's.
    let upserted: HashSet<ProcessKey> = p
        .iter()
        .zip(&states)
        .filter(|(_, state)| **state == RowState::Upsert)
        .map(|(row, _)| ProcessKey::of(row))
        .collect();
    let steady_ids: Vec<Option<i64>> = p
        .iter()
        .zip(states)
        .map(|(row, state)| match state {
            RowState::Steady(id) if !upserted.contains(&ProcessKey::of(row)) => Some(id),
            _ => None,
        })
        .collect();
    let mut ids = steady_ids.clone();
    let changed: Vec<&ProcessSampleRow> = p
        .iter()
        .zip(&ids)
        .filter(|(_, id)| id.is_none())
        .map(|(row, _)| *row)
        .collect();
    if !changed.is_empty() {
        let upserted = upsert_processes(tx, &changed).await?;
        for (row, id) in p.iter().zip(ids.iter_mut()) {
            if id.is_none() {
                *id = upserted.get(&ProcessKey::of(row)).copied();
            }
        }
    }
    // Every upserted key comes back; a sample without an id would be a bug,
    // and is left out rather than stored under another process.
    let stored: Vec<(i64, &ProcessSampleRow, bool)> = p
        .iter()
        .zip(&ids)
        .zip(&steady_ids)
        .filter_map(|((row, id), steady)| Some(((*id)?, *row, steady.is_some())))
        .collect();
    // The memory goes with the time: another collector may have written
    // the row since this one last did, with a value this sample's replaces.
    let newest = |steady: bool| -> Vec<ProcessSeen> {
        let samples: Vec<ProcessSeen> = stored
            .iter()
            .filter(|(_, _, was_steady)| *was_steady == steady)
            .map(|(id, row, _)| ProcessSeen {
                process_id: *id,
                timestamp_ms: row.timestamp_ms,
                memory: row.used_last,
            })
            .collect();
        let refs: Vec<&ProcessSeen> = samples.iter().collect();
        newest_per_key(&refs).into_iter().copied().collect()
    };
    Ok(ProcessesWritten {
        steady: newest(true),
        upserted: newest(false),
        committed: stored.iter().map(|(id, row, _)| (*id, *row)).collect(),
    })
}

/// Inserts or updates the row of every process of `p` (one per process,
/// from its newest sample, with the peak and first sighting of all of
/// them); returns each row's id.
async fn upsert_processes(
    tx: &mut Transaction<'_, Postgres>,
    p: &[&ProcessSampleRow],
) -> Result<HashMap<ProcessKey, i64>, StoreError> {
    let device = device_ids(p.iter().map(|r| r.device_id))?;
    let pid: Vec<i64> = p.iter().map(|r| r.pid).collect();
    let start: Vec<i64> = p.iter().map(|r| r.start_time_ms).collect();
    let ts: Vec<i64> = p.iter().map(|r| r.timestamp_ms).collect();
    let last: Vec<i64> = p.iter().map(|r| r.used_last).collect();
    let max: Vec<i64> = p.iter().map(|r| r.used_max).collect();
    let name: Vec<&str> = p.iter().map(|r| r.name.as_str()).collect();
    let uid: Vec<i64> = p.iter().map(|r| r.uid).collect();
    let user: Vec<&str> = p.iter().map(|r| r.user.as_str()).collect();
    let container: Vec<&str> = p.iter().map(|r| r.container_id.as_str()).collect();
    let pod: Vec<&str> = p.iter().map(|r| r.pod_uid.as_str()).collect();
    let job: Vec<&str> = p.iter().map(|r| r.slurm_job_id.as_str()).collect();
    let runtime: Vec<&str> = p.iter().map(|r| r.container_runtime.as_str()).collect();
    let qos: Vec<&str> = p.iter().map(|r| r.pod_qos_class.as_str()).collect();
    let rows = sqlx::query(
        "INSERT INTO processes AS p (device_id, pid, start_time_ms, name, uid, user_name, container_id, pod_uid,
             slurm_job_id, container_runtime, pod_qos_class, first_seen_ms, last_seen_ms, memory_last, memory_peak)
         SELECT DISTINCT ON (d, pid, st) d, pid, st, n, u, un, c, pod, j, rt, q,
             MIN(t) OVER (PARTITION BY d, pid, st), t, l, MAX(m) OVER (PARTITION BY d, pid, st)
         FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::text[],
             $8::int8[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::text[])
             AS s(d, pid, st, t, l, m, n, u, un, c, pod, j, rt, q)
         ORDER BY d, pid, st, t DESC
         ON CONFLICT (device_id, pid, start_time_ms) DO UPDATE SET
             name = EXCLUDED.name, uid = EXCLUDED.uid, user_name = EXCLUDED.user_name,
             container_id = EXCLUDED.container_id, pod_uid = EXCLUDED.pod_uid, slurm_job_id = EXCLUDED.slurm_job_id,
             container_runtime = EXCLUDED.container_runtime, pod_qos_class = EXCLUDED.pod_qos_class,
             first_seen_ms = LEAST(p.first_seen_ms, EXCLUDED.first_seen_ms),
             memory_last = CASE WHEN EXCLUDED.last_seen_ms >= p.last_seen_ms THEN EXCLUDED.memory_last ELSE p.memory_last END,
             last_seen_ms = GREATEST(p.last_seen_ms, EXCLUDED.last_seen_ms),
             memory_peak = GREATEST(p.memory_peak, EXCLUDED.memory_peak)
         RETURNING p.id, p.device_id::int8 AS device_id, p.pid, p.start_time_ms",
    )
    .bind(&device)
    .bind(&pid)
    .bind(&start)
    .bind(&ts)
    .bind(&last)
    .bind(&max)
    .bind(&name)
    .bind(&uid)
    .bind(&user)
    .bind(&container)
    .bind(&pod)
    .bind(&job)
    .bind(&runtime)
    .bind(&qos)
    .fetch_all(&mut **tx)
    .await?;
    let mut ids = HashMap::with_capacity(rows.len());
    for row in rows {
        ids.insert(
            ProcessKey::new(
                row.try_get("device_id")?,
                row.try_get("pid")?,
                row.try_get("start_time_ms")?,
            ),
            row.try_get("id")?,
        );
    }
    Ok(ids)
}

/// Where samples are written as rows, a row per allocator report (a
/// report joined to several intervals is stored once); where they are
/// written as chunks, the reports wait in open chunks with them instead.
async fn write_allocator_rows(
    tx: &mut Transaction<'_, Postgres>,
    samples: &[&ProcessSampleRow],
) -> Result<(), StoreError> {
    let reporting: Vec<(&ProcessSampleRow, &AllocatorRow)> = samples
        .iter()
        .filter_map(|s| s.allocator.as_ref().map(|a| (*s, a)))
        .collect();
    if reporting.is_empty() {
        return Ok(());
    }
    let column =
        |f: fn(&AllocatorRow) -> i64| -> Vec<i64> { reporting.iter().map(|(_, a)| f(a)).collect() };
    let part_bytes =
        |i: usize| -> Vec<Option<i64>> { reporting.iter().map(|(_, a)| a.parts()[i].0).collect() };
    sqlx::query(
        "INSERT INTO allocator_samples (process_id, ts_ms, allocated, reserved, active, inactive_split,
             peak_allocated, alloc_retries, ooms, weights, gradients, optimizer_state)
         SELECT DISTINCT ON (p.id, s.t) p.id, s.t, s.a, s.r, s.ac, s.i, s.pk, s.rt, s.o, s.w, s.g, s.os
         FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[],
             $8::int8[], $9::int8[], $10::int8[], $11::int8[], $12::int8[], $13::int8[], $14::int8[])
             AS s(d, pid, st, t, a, r, ac, i, pk, rt, o, w, g, os)
         JOIN processes p ON p.device_id = s.d AND p.pid = s.pid AND p.start_time_ms = s.st
         ON CONFLICT (process_id, ts_ms) DO NOTHING",
    )
    .bind(device_ids(reporting.iter().map(|(s, _)| s.device_id))?)
    .bind(reporting.iter().map(|(s, _)| s.pid).collect::<Vec<_>>())
    .bind(reporting.iter().map(|(s, _)| s.start_time_ms).collect::<Vec<_>>())
    .bind(column(|a| a.timestamp_ms))
    .bind(column(|a| a.allocated))
    .bind(column(|a| a.reserved))
    .bind(column(|a| a.active))
    .bind(column(|a| a.inactive_split))
    .bind(column(|a| a.peak_allocated))
    .bind(column(|a| a.alloc_retries))
    .bind(column(|a| a.ooms))
    .bind(part_bytes(0))
    .bind(part_bytes(1))
    .bind(part_bytes(2))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Each reporting process's newest report among the stored samples, in
/// process id order.
fn newest_allocator_reports(committed: &[(i64, &ProcessSampleRow)]) -> Vec<AllocatorSeen> {
    let reports: Vec<AllocatorSeen> = committed
        .iter()
        .filter_map(|(id, row)| {
            row.allocator.map(|report| AllocatorSeen {
                process_id: *id,
                report,
            })
        })
        .collect();
    let refs: Vec<&AllocatorSeen> = reports.iter().collect();
    newest_per_key(&refs).into_iter().copied().collect()
}

/// Copies each of `reports` (one per process, in id order) onto its
/// process's row, where the row holds no newer one: the `alloc_*` columns
/// that the process list and the job pages read; with the process's memory
/// and last-seen time where they come along. A row holding a newer report
/// (another collector's) takes neither: its last-seen time then trails
/// until the next checkpoint, as a steady one does.
pub(super) async fn write_allocator_checkpoints(
    conn: &mut PgConnection,
    reports: &[(AllocatorSeen, Option<ProcessSeen>)],
) -> Result<(), StoreError> {
    if reports.is_empty() {
        return Ok(());
    }
    let column = |f: fn(&AllocatorRow) -> i64| -> Vec<i64> {
        reports.iter().map(|(r, _)| f(&r.report)).collect()
    };
    let seen = |f: fn(&ProcessSeen) -> i64| -> Vec<Option<i64>> {
        reports.iter().map(|(_, s)| s.as_ref().map(f)).collect()
    };
    let parts: Vec<_> = reports.iter().map(|(r, _)| r.report.parts()).collect();
    let part_bytes = |i: usize| -> Vec<Option<i64>> { parts.iter().map(|p| p[i].0).collect() };
    let part_dtype = |i: usize| -> Vec<Option<&str>> { parts.iter().map(|p| p[i].1).collect() };
    sqlx::query(
        "UPDATE processes p SET alloc_ts_ms = s.t, alloc_allocated = s.a, alloc_reserved = s.r,
             alloc_inactive_split = s.i, alloc_peak_allocated = s.pk, alloc_retries = s.rt, alloc_ooms = s.o,
             alloc_weights = s.w, alloc_weights_dtype = s.wd, alloc_gradients = s.g,
             alloc_gradients_dtype = s.gd, alloc_optimizer_state = s.os, alloc_optimizer_state_dtype = s.od,
             memory_last = CASE WHEN s.seen >= p.last_seen_ms THEN s.mem ELSE p.memory_last END,
             last_seen_ms = GREATEST(p.last_seen_ms, s.seen)
         FROM UNNEST($1::int8[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[],
             $8::int8[], $9::int8[], $10::text[], $11::int8[], $12::text[], $13::int8[], $14::text[],
             $15::int8[], $16::int8[])
             AS s(id, t, a, r, i, pk, rt, o, w, wd, g, gd, os, od, seen, mem)
         WHERE p.id = ANY($1) AND p.id = s.id AND (p.alloc_ts_ms IS NULL OR p.alloc_ts_ms <= s.t)",
    )
    .bind(reports.iter().map(|(r, _)| r.process_id).collect::<Vec<_>>())
    .bind(column(|a| a.timestamp_ms))
    .bind(column(|a| a.allocated))
    .bind(column(|a| a.reserved))
    .bind(column(|a| a.inactive_split))
    .bind(column(|a| a.peak_allocated))
    .bind(column(|a| a.alloc_retries))
    .bind(column(|a| a.ooms))
    .bind(part_bytes(0))
    .bind(part_dtype(0))
    .bind(part_bytes(1))
    .bind(part_dtype(1))
    .bind(part_bytes(2))
    .bind(part_dtype(2))
    .bind(seen(|s| s.timestamp_ms))
    .bind(seen(|s| s.memory))
    .execute(conn)
    .await?;
    Ok(())
}

async fn write_events(
    tx: &mut Transaction<'_, Postgres>,
    e: &[(i64, &EventRow)],
) -> Result<(), StoreError> {
    if e.is_empty() {
        return Ok(());
    }
    let node: Vec<i64> = e.iter().map(|(n, _)| *n).collect();
    let device: Vec<Option<i32>> = e
        .iter()
        .map(|(_, r)| r.device_id.map(device_id).transpose())
        .collect::<Result<_, _>>()?;
    let ts: Vec<i64> = e.iter().map(|(_, r)| r.timestamp_ms).collect();
    let kind: Vec<&str> = e.iter().map(|(_, r)| r.kind).collect();
    let code: Vec<i64> = e.iter().map(|(_, r)| r.code).collect();
    let pid: Vec<i64> = e.iter().map(|(_, r)| r.pid).collect();
    let detail: Vec<&str> = e.iter().map(|(_, r)| r.detail.as_str()).collect();
    sqlx::query(
        "INSERT INTO events (node_id, device_id, ts_ms, kind, code, pid, detail)
         SELECT * FROM UNNEST($1::int8[], $2::int4[], $3::int8[], $4::text[], $5::int8[], $6::int8[], $7::text[])",
    )
    .bind(&node)
    .bind(&device)
    .bind(&ts)
    .bind(&kind)
    .bind(&code)
    .bind(&pid)
    .bind(&detail)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The whole span of timestamps in `batches`, for creating partitions a
/// write found missing.
pub(super) fn time_span(batches: &[StoreBatch]) -> Option<(i64, i64)> {
    let all = batches.iter().flat_map(|b| {
        let gpus = b.gpu_samples.iter().map(|s| s.timestamp_ms);
        let procs = b.process_samples.iter().flat_map(|s| {
            std::iter::once(s.timestamp_ms).chain(s.allocator.map(|a| a.timestamp_ms))
        });
        let events = b.events.iter().map(|e| e.timestamp_ms);
        gpus.chain(procs).chain(events)
    });
    all.fold(None, |span, ts| match span {
        None => Some((ts, ts)),
        Some((lo, hi)) => Some((lo.min(ts), hi.max(ts))),
    })
}

/// Device ids are `INTEGER` in the schema (four bytes a row); one that does
/// not fit is refused, never truncated into another device's id.
fn device_id(id: i64) -> Result<i32, StoreError> {
    i32::try_from(id).map_err(|_| StoreError::Invalid(format!("device id {id} is out of range")))
}

fn device_ids(ids: impl Iterator<Item = i64>) -> Result<Vec<i32>, StoreError> {
    ids.map(device_id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(node_id: i64, boot_id: &str, seq: u64) -> StoreBatch {
        StoreBatch {
            node_id,
            boot_id: boot_id.into(),
            seq,
            ..StoreBatch::default()
        }
    }

    #[test]
    fn a_reporting_process_gets_its_memory_and_report_in_one_row_version() {
        let seen = |id: i64, ts: i64| ProcessSeen {
            process_id: id,
            timestamp_ms: ts,
            memory: ts * 10,
        };
        let report = |id: i64, ts: i64| AllocatorSeen {
            process_id: id,
            report: AllocatorRow {
                timestamp_ms: ts,
                allocated: 1,
                reserved: 2,
                active: 1,
                inactive_split: 0,
                peak_allocated: 1,
                alloc_retries: 0,
                ooms: 0,
                composition: None,
            },
        };
        // In the write: 1, 2 and 3 steady, 4 upserted; 1, 2 and 4 report.
        let written = ProcessesWritten {
            committed: Vec::new(),
            steady: vec![seen(1, 100), seen(2, 100), seen(3, 100)],
            upserted: vec![seen(4, 100)],
        };
        let reports = [report(1, 90), report(2, 90), report(4, 90)];
        let paired = pair_checkpoints(
            // 1's and 3's memory are due, and 6's, gone quiet.
            vec![seen(1, 100), seen(3, 100), seen(6, 50)],
            // 2's and 4's reports are due, and 5's, gone quiet.
            vec![report(2, 90), report(4, 90), report(5, 40)],
            &reports,
            &written,
        );
        assert_eq!(
            paired,
            ProcessCheckpoints {
                seen_alone: vec![seen(3, 100), seen(6, 50)],
                reports: vec![
                    (report(1, 90), Some(seen(1, 100))),
                    (report(2, 90), Some(seen(2, 100))),
                    (report(4, 90), None),
                    (report(5, 40), None),
                ],
            },
            "a report rides with its memory's checkpoint and the other way \
             round; an upserted row has its memory already"
        );
    }

    #[test]
    fn a_claim_leaves_out_replays_and_unregistered_boots() {
        let batches = [
            batch(2, "b", 5),
            batch(1, "a", 3),
            batch(1, "a", 3),
            batch(1, "a", 4),
            batch(2, "b", 4),
            batch(9, "z", 1),
        ];
        let seqs = |committed, durable| BootSeqs { committed, durable };
        let committed = HashMap::from([((1, "a"), seqs(2, 2)), ((2, "b"), seqs(4, 4))]);
        let claim = Claim::with_seqs(&batches, &committed, false);
        assert_eq!(
            claim.outcomes,
            vec![
                WriteOutcome::Committed,
                WriteOutcome::Committed,
                WriteOutcome::Duplicate { committed_seq: 3 },
                WriteOutcome::Committed,
                WriteOutcome::Duplicate { committed_seq: 5 },
                WriteOutcome::Duplicate { committed_seq: 0 },
            ]
        );
        let accepted: Vec<u64> = claim.accepted.iter().map(|b| b.seq).collect();
        assert_eq!(accepted, vec![5, 3, 4]);
        let moves: Vec<(i64, i64, i64)> = claim
            .boots
            .iter()
            .map(|m| (m.node_id, m.first_seq, m.last_seq))
            .collect();
        assert_eq!(moves, vec![(1, 3, 4), (2, 5, 5)], "in key order");
    }
}
