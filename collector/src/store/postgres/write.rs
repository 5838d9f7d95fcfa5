//! Writing a group of batches, from any number of agents, in one
//! transaction: the seq check of every batch, then one binary `COPY` per
//! sample table and one `UNNEST` statement per other table for all of
//! their rows. A batch whose seq was already committed is
//! left out and reported as a duplicate, inside the same transaction that
//! writes the others, so two collectors can never both store one batch.

use std::collections::{BTreeMap, HashMap};

use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Postgres, Row, Transaction};

use super::copy::{BinaryRows, copy_in};
use super::latest_cache::{LatestCache, newest_per_device};
use super::process_cache::{ProcessCache, ProcessKey, RowState};
use crate::model::{
    AllocatorRow, EventRow, GpuSampleRow, ProcessSampleRow, StoreBatch, WriteOutcome,
};
use crate::store::StoreError;
use crate::store::rollup::{MINUTE_MS, late_minutes};

/// Writes `batches` in one transaction; one outcome per batch, in order.
/// `now_ms` is the wall clock, which paces the checkpoint rows.
pub(super) async fn write_group(
    pool: &PgPool,
    process_cache: &ProcessCache,
    latest_cache: &LatestCache,
    batches: &[StoreBatch],
    now_ms: i64,
) -> Result<Vec<WriteOutcome>, StoreError> {
    let mut tx = pool.begin().await?;
    let Claimed {
        outcomes,
        accepted,
        watermark,
    } = claim_seqs(&mut tx, batches).await?;
    if accepted.is_empty() {
        tx.rollback().await?;
        return Ok(outcomes);
    }

    let gpu: Vec<&GpuSampleRow> = accepted.iter().flat_map(|b| &b.gpu_samples).collect();
    let processes: Vec<&ProcessSampleRow> =
        accepted.iter().flat_map(|b| &b.process_samples).collect();
    let events: Vec<(i64, &EventRow)> = accepted
        .iter()
        .flat_map(|b| b.events.iter().map(|e| (b.node_id, e)))
        .collect();
    let latest = write_gpu_samples(&mut tx, latest_cache, &gpu, now_ms).await?;
    let learned = write_process_samples(&mut tx, process_cache, &processes).await?;
    write_allocator_samples(&mut tx, &processes).await?;
    write_events(&mut tx, &events).await?;
    touch_nodes(&mut tx, &accepted).await?;
    if let Some(watermark) = watermark {
        let timestamps = gpu
            .iter()
            .map(|s| s.timestamp_ms)
            .chain(processes.iter().map(|s| s.timestamp_ms));
        let late = late_minutes(timestamps, watermark);
        if !late.is_empty() {
            mark_minutes_pending(&mut tx, &late).await?;
        }
    }
    tx.commit().await?;
    process_cache.learn(&learned);
    latest_cache.learn(&latest.newest, &latest.written, now_ms);
    Ok(outcomes)
}

/// Marks `minutes` for the rollup job to redo, in this transaction: the
/// mark commits with the rows it stands for. A plain insert (marks may
/// repeat) that waits for no other writer and no rollup in progress: the
/// job takes only the marks committed before it looked, so a mark of this
/// transaction is either seen with these rows or left for the next pass.
async fn mark_minutes_pending(
    tx: &mut Transaction<'_, Postgres>,
    minutes: &[i64],
) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO rollup_pending (step_ms, bucket_ms) SELECT $1, UNNEST($2::int8[])")
        .bind(MINUTE_MS)
        .bind(minutes)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

struct Claimed<'b> {
    outcomes: Vec<WriteOutcome>,
    accepted: Vec<&'b StoreBatch>,
    /// The minute rollup's watermark, held in share mode until commit.
    watermark: Option<i64>,
}

/// Locks the boots of `batches` (in key order, so two collectors writing
/// overlapping groups cannot deadlock), decides which batches are new and
/// moves each boot's committed seq.
///
/// The same statement takes the minute watermark's row in share mode until
/// commit: the rollup job cannot move it past these rows' minutes without
/// waiting for this transaction, so every row is either before the
/// watermark and marked pending here, or after it and rolled up later.
async fn claim_seqs<'b>(
    tx: &mut Transaction<'_, Postgres>,
    batches: &'b [StoreBatch],
) -> Result<Claimed<'b>, StoreError> {
    let nodes: Vec<i64> = batches.iter().map(|b| b.node_id).collect();
    let boots: Vec<&str> = batches.iter().map(|b| b.boot_id.as_str()).collect();
    let rows = sqlx::query(
        "SELECT b.node_id, b.boot_id, b.committed_seq
         FROM agent_boots b JOIN (SELECT DISTINCT * FROM UNNEST($1::int8[], $2::text[])) AS k(node_id, boot_id)
             ON b.node_id = k.node_id AND b.boot_id = k.boot_id
         ORDER BY b.node_id, b.boot_id
         FOR UPDATE OF b",
    )
    .bind(&nodes)
    .bind(&boots)
    .fetch_all(&mut **tx)
    .await?;
    let mut committed: HashMap<(i64, String), (i64, bool)> = HashMap::with_capacity(rows.len());
    for row in rows {
        committed.insert(
            (row.try_get("node_id")?, row.try_get("boot_id")?),
            (row.try_get("committed_seq")?, false),
        );
    }
    let mut outcomes = Vec::with_capacity(batches.len());
    let mut accepted = Vec::with_capacity(batches.len());
    for batch in batches {
        let seq = i64::try_from(batch.seq).unwrap_or(i64::MAX);
        match committed.get_mut(&(batch.node_id, batch.boot_id.clone())) {
            Some((current, moved)) if *current < seq => {
                *current = seq;
                *moved = true;
                outcomes.push(WriteOutcome::Committed);
                accepted.push(batch);
            }
            found => outcomes.push(WriteOutcome::Duplicate {
                committed_seq: found.and_then(|(c, _)| u64::try_from(*c).ok()).unwrap_or(0),
            }),
        }
    }
    let moved: Vec<(&(i64, String), i64)> = committed
        .iter()
        .filter(|(_, (_, moved))| *moved)
        .map(|(key, (seq, _))| (key, *seq))
        .collect();
    let mut watermark = None;
    if !moved.is_empty() {
        let nodes: Vec<i64> = moved.iter().map(|((n, _), _)| *n).collect();
        let boots: Vec<&str> = moved.iter().map(|((_, b), _)| b.as_str()).collect();
        let seqs: Vec<i64> = moved.iter().map(|(_, s)| *s).collect();
        watermark = sqlx::query_scalar(
            "WITH moved AS (
                 UPDATE agent_boots b SET committed_seq = v.seq
                 FROM UNNEST($1::int8[], $2::text[], $3::int8[]) AS v(node_id, boot_id, seq)
                 WHERE b.node_id = v.node_id AND b.boot_id = v.boot_id)
             SELECT done_until_ms FROM rollup_progress WHERE step_ms = $4 FOR SHARE",
        )
        .bind(&nodes)
        .bind(&boots)
        .bind(&seqs)
        .bind(MINUTE_MS)
        .fetch_optional(&mut **tx)
        .await?;
    }
    Ok(Claimed {
        outcomes,
        accepted,
        watermark,
    })
}

/// What a write did to `gpu_latest`, for the cache to learn after commit.
struct LatestWritten<'r> {
    newest: Vec<&'r GpuSampleRow>,
    written: Vec<GpuSampleRow>,
}

async fn write_gpu_samples<'r>(
    tx: &mut Transaction<'_, Postgres>,
    latest_cache: &LatestCache,
    s: &[&'r GpuSampleRow],
    now_ms: i64,
) -> Result<LatestWritten<'r>, StoreError> {
    if s.is_empty() {
        return Ok(LatestWritten {
            newest: Vec::new(),
            written: Vec::new(),
        });
    }
    copy_in(tx, GPU_SAMPLES_COPY, gpu_sample_rows(s.iter().copied())?).await?;
    // One sample per device: ON CONFLICT may touch a row once per statement.
    let newest = newest_per_device(s);
    let written = latest_cache.due(&newest, now_ms);
    write_gpu_latest(tx, &written).await?;
    Ok(LatestWritten { newest, written })
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
/// to its sample in `s` (one per device), unless a newer one is already
/// there.
pub(super) async fn write_gpu_latest(
    conn: &mut PgConnection,
    s: &[GpuSampleRow],
) -> Result<(), StoreError> {
    if s.is_empty() {
        return Ok(());
    }
    let device = device_ids(s.iter().map(|r| r.device_id))?;
    let ts: Vec<i64> = s.iter().map(|r| r.timestamp_ms).collect();
    let last: Vec<i64> = s.iter().map(|r| r.used_last).collect();
    let min: Vec<i64> = s.iter().map(|r| r.used_min).collect();
    let max: Vec<i64> = s.iter().map(|r| r.used_max).collect();
    let reserved: Vec<i64> = s.iter().map(|r| r.reserved).collect();
    let total: Vec<i64> = s.iter().map(|r| r.total).collect();
    let util: Vec<Option<i16>> = s.iter().map(|r| r.utilization_pct).collect();
    let tx_rate: Vec<Option<i64>> = s.iter().map(|r| r.pcie_tx_bytes_per_s).collect();
    let rx_rate: Vec<Option<i64>> = s.iter().map(|r| r.pcie_rx_bytes_per_s).collect();
    sqlx::query(
        "INSERT INTO gpu_latest (device_id, ts_ms, used_last, used_min, used_max, reserved, total, utilization, pcie_tx, pcie_rx)
         SELECT * FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[],
             $7::int8[], $8::int2[], $9::int8[], $10::int8[])
         ON CONFLICT (device_id) DO UPDATE SET ts_ms = EXCLUDED.ts_ms, used_last = EXCLUDED.used_last,
             used_min = EXCLUDED.used_min, used_max = EXCLUDED.used_max, reserved = EXCLUDED.reserved,
             total = EXCLUDED.total, utilization = EXCLUDED.utilization, pcie_tx = EXCLUDED.pcie_tx,
             pcie_rx = EXCLUDED.pcie_rx
         WHERE gpu_latest.ts_ms <= EXCLUDED.ts_ms",
    )
    .bind(&device)
    .bind(&ts)
    .bind(&last)
    .bind(&min)
    .bind(&max)
    .bind(&reserved)
    .bind(&total)
    .bind(&util)
    .bind(&tx_rate)
    .bind(&rx_rate)
    .execute(conn)
    .await?;
    Ok(())
}

/// Process samples, and the rows of the processes they belong to. A
/// process this collector wrote recently and that has not changed (most,
/// between allocator growth steps) keeps its row, but for its last-seen
/// time and memory every few seconds; its samples go in by the id the
/// cache knows. The others are upserted, which returns their ids.
/// Returns what the cache may learn once the transaction commits.
async fn write_process_samples<'r>(
    tx: &mut Transaction<'_, Postgres>,
    cache: &ProcessCache,
    p: &[&'r ProcessSampleRow],
) -> Result<Vec<(i64, &'r ProcessSampleRow)>, StoreError> {
    if p.is_empty() {
        return Ok(Vec::new());
    }
    let states = cache.states(p);
    let mut ids: Vec<Option<i64>> = states
        .iter()
        .map(|state| match state {
            RowState::Steady(id) | RowState::Refresh(id) => Some(*id),
            RowState::Upsert => None,
        })
        .collect();
    let mut learned = Vec::new();
    // Per row, the newest sample's time and memory; sorted by id so that
    // two writers update rows in the same order.
    let mut refreshed: BTreeMap<i64, (i64, i64)> = BTreeMap::new();
    for (row, state) in p.iter().zip(&states) {
        if let RowState::Refresh(id) = *state {
            let seen = refreshed
                .entry(id)
                .or_insert((row.timestamp_ms, row.used_last));
            if row.timestamp_ms > seen.0 {
                *seen = (row.timestamp_ms, row.used_last);
            }
            learned.push((id, *row));
        }
    }
    if !refreshed.is_empty() {
        let refresh_ids: Vec<i64> = refreshed.keys().copied().collect();
        let seen: Vec<i64> = refreshed.values().map(|(ts, _)| *ts).collect();
        let last: Vec<i64> = refreshed.values().map(|(_, used)| *used).collect();
        // The memory too: another collector may have written the row since
        // this one last did, with a value this sample's replaces.
        sqlx::query(
            "UPDATE processes p SET
                 memory_last = CASE WHEN v.ts >= p.last_seen_ms THEN v.last ELSE p.memory_last END,
                 last_seen_ms = GREATEST(p.last_seen_ms, v.ts)
             FROM UNNEST($1::int8[], $2::int8[], $3::int8[]) AS v(id, ts, last) WHERE p.id = v.id",
        )
        .bind(&refresh_ids)
        .bind(&seen)
        .bind(&last)
        .execute(&mut **tx)
        .await?;
    }
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
                if let Some(id) = *id {
                    learned.push((id, *row));
                }
            }
        }
    }
    // Every upserted key comes back; a sample without an id would be a bug,
    // and is left out rather than stored under another process.
    let (rows, ids): (Vec<&ProcessSampleRow>, Vec<i64>) = p
        .iter()
        .zip(ids)
        .filter_map(|(row, id)| Some((*row, id?)))
        .unzip();
    let copy = process_sample_rows(
        rows.iter()
            .zip(ids)
            .map(|(row, id)| (id, row.timestamp_ms, row.used_last, row.used_max)),
    );
    copy_in(tx, PROCESS_SAMPLES_COPY, copy).await?;
    Ok(learned)
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

/// The allocator reports that came with the process samples: one row per
/// report (a report joined to several intervals is stored once), and the
/// newest one on the process's row.
async fn write_allocator_samples(
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
    let device = device_ids(reporting.iter().map(|(s, _)| s.device_id))?;
    let pid: Vec<i64> = reporting.iter().map(|(s, _)| s.pid).collect();
    let start: Vec<i64> = reporting.iter().map(|(s, _)| s.start_time_ms).collect();
    let ts = column(|a| a.timestamp_ms);
    let allocated = column(|a| a.allocated);
    let reserved = column(|a| a.reserved);
    let active = column(|a| a.active);
    let inactive_split = column(|a| a.inactive_split);
    let peak = column(|a| a.peak_allocated);
    let retries = column(|a| a.alloc_retries);
    let ooms = column(|a| a.ooms);
    sqlx::query(
        "INSERT INTO allocator_samples (process_id, ts_ms, allocated, reserved, active, inactive_split,
             peak_allocated, alloc_retries, ooms)
         SELECT DISTINCT ON (p.id, s.t) p.id, s.t, s.a, s.r, s.ac, s.i, s.pk, s.rt, s.o
         FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[],
             $8::int8[], $9::int8[], $10::int8[], $11::int8[]) AS s(d, pid, st, t, a, r, ac, i, pk, rt, o)
         JOIN processes p ON p.device_id = s.d AND p.pid = s.pid AND p.start_time_ms = s.st
         ON CONFLICT (process_id, ts_ms) DO NOTHING",
    )
    .bind(&device)
    .bind(&pid)
    .bind(&start)
    .bind(&ts)
    .bind(&allocated)
    .bind(&reserved)
    .bind(&active)
    .bind(&inactive_split)
    .bind(&peak)
    .bind(&retries)
    .bind(&ooms)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE processes p SET alloc_ts_ms = s.t, alloc_allocated = s.a, alloc_reserved = s.r,
             alloc_inactive_split = s.i, alloc_peak_allocated = s.pk, alloc_retries = s.rt, alloc_ooms = s.o
         FROM (SELECT DISTINCT ON (d, pid, st) *
               FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[],
                   $8::int8[], $9::int8[], $10::int8[]) AS u(d, pid, st, t, a, r, i, pk, rt, o)
               ORDER BY d, pid, st, t DESC) s
         WHERE p.device_id = s.d AND p.pid = s.pid AND p.start_time_ms = s.st
             AND (p.alloc_ts_ms IS NULL OR p.alloc_ts_ms <= s.t)",
    )
    .bind(&device)
    .bind(&pid)
    .bind(&start)
    .bind(&ts)
    .bind(&allocated)
    .bind(&reserved)
    .bind(&inactive_split)
    .bind(&peak)
    .bind(&retries)
    .bind(&ooms)
    .execute(&mut **tx)
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

/// Moves each node's last-seen time to its newest sample in the group.
async fn touch_nodes(
    tx: &mut Transaction<'_, Postgres>,
    batches: &[&StoreBatch],
) -> Result<(), StoreError> {
    let mut newest: HashMap<i64, i64> = HashMap::new();
    for batch in batches {
        if let Some(ts) = batch.newest_timestamp_ms() {
            let entry = newest.entry(batch.node_id).or_insert(ts);
            *entry = (*entry).max(ts);
        }
    }
    if newest.is_empty() {
        return Ok(());
    }
    let (nodes, times): (Vec<i64>, Vec<i64>) = newest.into_iter().unzip();
    sqlx::query(
        "UPDATE nodes n SET last_seen_ms = GREATEST(n.last_seen_ms, v.ts)
         FROM UNNEST($1::int8[], $2::int8[]) AS v(id, ts) WHERE n.id = v.id",
    )
    .bind(&nodes)
    .bind(&times)
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
