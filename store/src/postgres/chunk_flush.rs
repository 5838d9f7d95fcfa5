//! Writing the open chunks: every series' held samples as compressed chunks
//! (one row per series and hour they touch), their minute rollups merged
//! into the rollup tables, and each stream's durable mark, in one
//! transaction. Once it commits, the agents may forget those batches.
//!
//! Exactly once across collectors: a flush locks the durable marks of its
//! streams (their own table, so batch writes never wait for a flush) and
//! leaves out the samples of batches another collector already made
//! durable; an agent that moved holds its batches in both collectors until
//! one of them writes them.

use std::collections::HashMap;
use std::sync::Arc;

use sqlx::postgres::PgConnection;
use sqlx::{Connection, Postgres, Row, Transaction};

use super::maintenance::roll_up_fleet;
use super::packing::insert_chunks;
use super::rollup_packing::unpack_for_late_minutes;
use crate::StoreError;
use crate::flush_encoding::{Encoded, SeriesHours, encode_off_runtime};
use crate::model::{AllocatorReport, GpuSampleRow, ProcessPoint};
use crate::open_chunks::{GpuMinute, ProcessMinute, Samples, StreamKey};
use crate::rollup::{HOUR_MS, MINUTE_MS, bucket_start, contiguous_runs};

/// What a flush wrote.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Flushed {
    pub chunks: usize,
    pub chunk_bytes: usize,
    pub samples: usize,
    /// Samples another collector had already written.
    pub left_out: usize,
    /// Each stream's durable mark after the flush.
    pub marks: Vec<(StreamKey, u64)>,
}

/// Writes `taken` and commits; see the module's notes.
pub(super) async fn write_open_chunks(
    conn: &mut PgConnection,
    taken: Arc<Samples>,
) -> Result<Flushed, StoreError> {
    let mut encoded = encode_off_runtime(taken.clone()).await?;
    let mut tx = conn.begin().await?;
    let durable = lock_marks(&mut tx, &taken.streams).await?;
    let mut left_out = 0;
    let needs_leaving_out = taken.streams.iter().zip(&taken.seqs).any(|(key, seqs)| {
        let mark = durable.get(key).copied().unwrap_or(0);
        seqs.first().is_some_and(|&first| first <= mark)
    });
    let kept = if needs_leaving_out {
        let mut kept = (*taken).clone();
        left_out = kept.retain_above(&durable);
        tracing::info!(
            left_out,
            "a flush left out samples another collector already wrote (an agent moved)"
        );
        let kept = Arc::new(kept);
        encoded = encode_off_runtime(kept.clone()).await?;
        kept
    } else {
        taken
    };
    insert_chunks::<GpuSampleRow>(&mut tx, &encoded.gpu_chunks).await?;
    insert_chunks::<ProcessPoint>(&mut tx, &encoded.process_chunks).await?;
    insert_chunks::<AllocatorReport>(&mut tx, &encoded.allocator_chunks).await?;
    let minute_watermark = minute_watermark_for_share(&mut tx).await?;
    let late_series = minute_watermark.map(|done_until| encoded.late_series_hours(done_until));
    if let Some((gpus, processes)) = &late_series {
        unpack_for_late_minutes(&mut tx, (gpus, processes)).await?;
    }
    merge_gpu_minutes(&mut tx, &encoded.gpu_minutes).await?;
    merge_process_minutes(&mut tx, &encoded.process_minutes).await?;
    if let (Some(done_until), Some(late_series)) = (minute_watermark, late_series) {
        redo_late_buckets(&mut tx, &encoded, done_until, late_series).await?;
    }
    mark_for_compaction(&mut tx, &encoded).await?;
    let mut marks: Vec<(StreamKey, u64)> = kept
        .last_seqs()
        .into_iter()
        .map(|(key, seq)| (key.clone(), seq))
        .collect();
    raise_marks(&mut tx, &marks).await?;
    tx.commit().await?;
    // Streams whose every batch here another collector wrote keep its mark.
    for (key, mark) in durable {
        if !marks.iter().any(|(k, _)| *k == key) {
            marks.push((key, mark));
        }
    }
    Ok(Flushed {
        chunks: encoded.chunks().count(),
        chunk_bytes: encoded
            .chunks()
            .map(crate::chunk_format::Chunk::bytes)
            .sum(),
        samples: encoded.samples(),
        left_out,
        marks,
    })
}

/// Locks the durable marks of `streams` (creating those that have none),
/// in key order so that two flushes cannot deadlock; returns them.
async fn lock_marks(
    tx: &mut Transaction<'_, Postgres>,
    streams: &[StreamKey],
) -> Result<HashMap<StreamKey, u64>, StoreError> {
    let mut sorted: Vec<&StreamKey> = streams.iter().collect();
    sorted.sort();
    let nodes: Vec<i64> = sorted.iter().map(|k| k.0).collect();
    let boots: Vec<&str> = sorted.iter().map(|k| k.1.as_str()).collect();
    // A stream of a node deleted meanwhile gets no mark (and its samples,
    // whose devices went with the node, no readers).
    sqlx::query(
        "INSERT INTO stream_durable (node_id, boot_id, durable_seq)
         SELECT v.node_id, v.boot_id, 0 FROM UNNEST($1::int8[], $2::text[]) AS v(node_id, boot_id)
         WHERE EXISTS (SELECT 1 FROM nodes n WHERE n.id = v.node_id)
         ON CONFLICT (node_id, boot_id) DO NOTHING",
    )
    .bind(&nodes)
    .bind(&boots)
    .execute(&mut **tx)
    .await?;
    let rows = sqlx::query(
        "SELECT d.node_id, d.boot_id, d.durable_seq FROM stream_durable d
         JOIN UNNEST($1::int8[], $2::text[]) AS v(node_id, boot_id)
             ON d.node_id = v.node_id AND d.boot_id = v.boot_id
         WHERE d.node_id = ANY($1)
         ORDER BY d.node_id, d.boot_id
         FOR UPDATE OF d",
    )
    .bind(&nodes)
    .bind(&boots)
    .fetch_all(&mut **tx)
    .await?;
    let mut marks = HashMap::with_capacity(rows.len());
    for row in rows {
        let seq: i64 = row.try_get("durable_seq")?;
        marks.insert(
            (row.try_get("node_id")?, row.try_get("boot_id")?),
            u64::try_from(seq).unwrap_or(0),
        );
    }
    Ok(marks)
}

async fn raise_marks(
    tx: &mut Transaction<'_, Postgres>,
    marks: &[(StreamKey, u64)],
) -> Result<(), StoreError> {
    if marks.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "UPDATE stream_durable d SET durable_seq = GREATEST(d.durable_seq, v.seq)
         FROM UNNEST($1::int8[], $2::text[], $3::int8[]) AS v(node_id, boot_id, seq)
         WHERE d.node_id = ANY($1) AND d.node_id = v.node_id AND d.boot_id = v.boot_id",
    )
    .bind(marks.iter().map(|(k, _)| k.0).collect::<Vec<_>>())
    .bind(marks.iter().map(|(k, _)| k.1.as_str()).collect::<Vec<_>>())
    .bind(
        marks
            .iter()
            .map(|(_, s)| i64::try_from(*s).unwrap_or(i64::MAX))
            .collect::<Vec<_>>(),
    )
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A minute row `r` merged with the same minute's `EXCLUDED` one: the
/// memory figures both rollup tables share.
pub(super) const MERGED_MEMORY: &str = "samples = r.samples + EXCLUDED.samples,
    last_ts_ms = GREATEST(r.last_ts_ms, EXCLUDED.last_ts_ms),
    used_last = CASE WHEN EXCLUDED.last_ts_ms >= r.last_ts_ms THEN EXCLUDED.used_last ELSE r.used_last END,
    used_min = LEAST(r.used_min, EXCLUDED.used_min),
    used_max = GREATEST(r.used_max, EXCLUDED.used_max),
    used_avg = round((r.used_avg::numeric * r.samples + EXCLUDED.used_avg::numeric * EXCLUDED.samples)
        / (r.samples + EXCLUDED.samples))::int8";

/// The rest of a GPU minute row `r` merged with `EXCLUDED`: the largest
/// reservation and total, and each optional mean over the samples that had it.
pub(super) const GPU_FIGURES_MERGED: &str = "reserved = GREATEST(r.reserved, EXCLUDED.reserved),
    total = GREATEST(r.total, EXCLUDED.total),
    utilization = ((COALESCE(r.utilization * r.samples, 0) + COALESCE(EXCLUDED.utilization * EXCLUDED.samples, 0))
        / NULLIF(CASE WHEN r.utilization IS NULL THEN 0 ELSE r.samples END
        + CASE WHEN EXCLUDED.utilization IS NULL THEN 0 ELSE EXCLUDED.samples END, 0))::real,
    pcie_tx = round((COALESCE(r.pcie_tx::numeric * r.samples, 0) + COALESCE(EXCLUDED.pcie_tx::numeric * EXCLUDED.samples, 0))
        / NULLIF(CASE WHEN r.pcie_tx IS NULL THEN 0 ELSE r.samples END
        + CASE WHEN EXCLUDED.pcie_tx IS NULL THEN 0 ELSE EXCLUDED.samples END, 0))::int8,
    pcie_rx = round((COALESCE(r.pcie_rx::numeric * r.samples, 0) + COALESCE(EXCLUDED.pcie_rx::numeric * EXCLUDED.samples, 0))
        / NULLIF(CASE WHEN r.pcie_rx IS NULL THEN 0 ELSE r.samples END
        + CASE WHEN EXCLUDED.pcie_rx IS NULL THEN 0 ELSE EXCLUDED.samples END, 0))::int8";

/// Merges minutes into `gpu_samples_1m`: a minute already there (the same
/// minute's earlier samples, or a late batch's) ends as the rollup of all
/// of them, each mean weighted by how many samples it holds.
async fn merge_gpu_minutes(
    tx: &mut Transaction<'_, Postgres>,
    minutes: &[GpuMinute],
) -> Result<(), StoreError> {
    if minutes.is_empty() {
        return Ok(());
    }
    let device_ids = minutes
        .iter()
        .map(|m| {
            i32::try_from(m.device_id).map_err(|_| {
                StoreError::Invalid(format!("device id {} is out of range", m.device_id))
            })
        })
        .collect::<Result<Vec<i32>, StoreError>>()?;
    sqlx::query(&format!(
        "INSERT INTO gpu_samples_1m AS r (device_id, ts_ms, last_ts_ms, samples, used_min, used_max,
             used_avg, used_last, reserved, total, utilization, pcie_tx, pcie_rx)
         SELECT * FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int4[], $5::int8[], $6::int8[],
             $7::int8[], $8::int8[], $9::int8[], $10::int8[], $11::float4[], $12::int8[], $13::int8[])
         ON CONFLICT (device_id, ts_ms) DO UPDATE SET {MERGED_MEMORY}, {GPU_FIGURES_MERGED}"
    ))
    .bind(device_ids)
    .bind(minutes.iter().map(|m| m.minute_ms).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.last_ts_ms).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| i32::try_from(m.samples).unwrap_or(i32::MAX)).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.used_min).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.used_max).collect::<Vec<_>>())
    .bind(minutes.iter().map(GpuMinute::used_avg).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.used_last).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.reserved).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.total).collect::<Vec<_>>())
    .bind(minutes.iter().map(GpuMinute::utilization).collect::<Vec<_>>())
    .bind(minutes.iter().map(GpuMinute::pcie_tx).collect::<Vec<_>>())
    .bind(minutes.iter().map(GpuMinute::pcie_rx).collect::<Vec<_>>())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn merge_process_minutes(
    tx: &mut Transaction<'_, Postgres>,
    minutes: &[ProcessMinute],
) -> Result<(), StoreError> {
    if minutes.is_empty() {
        return Ok(());
    }
    sqlx::query(&format!(
        "INSERT INTO process_samples_1m AS r (process_id, ts_ms, last_ts_ms, samples, used_min, used_max,
             used_avg, used_last)
         SELECT * FROM UNNEST($1::int8[], $2::int8[], $3::int8[], $4::int4[], $5::int8[], $6::int8[],
             $7::int8[], $8::int8[])
         ON CONFLICT (process_id, ts_ms) DO UPDATE SET {MERGED_MEMORY}"
    ))
    .bind(minutes.iter().map(|m| m.process_id).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.minute_ms).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.last_ts_ms).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| i32::try_from(m.samples).unwrap_or(i32::MAX)).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.used_min).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.used_max).collect::<Vec<_>>())
    .bind(minutes.iter().map(ProcessMinute::used_avg).collect::<Vec<_>>())
    .bind(minutes.iter().map(|m| m.used_last).collect::<Vec<_>>())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The hours these chunks went into, for the maintenance pass to compact
/// once they are closed.
async fn mark_for_compaction(
    tx: &mut Transaction<'_, Postgres>,
    encoded: &Encoded,
) -> Result<(), StoreError> {
    let hours = encoded.hours();
    if !hours.is_empty() {
        sqlx::query(
            "INSERT INTO compact_pending (hour_ms) SELECT UNNEST($1::int8[]) ON CONFLICT DO NOTHING",
        )
        .bind(&hours)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// The minute watermark, read under a share lock as batch writes read it,
/// so that the rollup pass cannot move it past this flush's minutes unseen
/// (nor, so, pack their hours) until the flush commits.
async fn minute_watermark_for_share(
    tx: &mut Transaction<'_, Postgres>,
) -> Result<Option<i64>, StoreError> {
    Ok(
        sqlx::query_scalar(
            "SELECT done_until_ms FROM rollup_progress WHERE step_ms = $1 FOR SHARE",
        )
        .bind(MINUTE_MS)
        .fetch_optional(&mut **tx)
        .await?,
    )
}

/// Past this many series hours late in one flush (a fleet replaying its
/// spools after a collector's outage), their hours are marked whole, so
/// that the marks stay few (where the cut should sit is not measured).
const SERIES_HOURS_MARKED_PER_FLUSH: usize = 10_000;

/// Minutes before the minute watermark `done_until` (a spool replayed
/// after an outage) get their fleet row summed again here, and the hours
/// of their series (`gpus`, `processes`: `Encoded::late_series_hours`)
/// marked for the next pass to roll up again, for those series alone;
/// newer minutes are summed when the pass reaches them.
async fn redo_late_buckets(
    tx: &mut Transaction<'_, Postgres>,
    encoded: &Encoded,
    done_until: i64,
    (gpus, processes): (SeriesHours, SeriesHours),
) -> Result<(), StoreError> {
    let late = encoded.minutes_before(done_until);
    if late.is_empty() {
        return Ok(());
    }
    for (from, to) in contiguous_runs(&late, MINUTE_MS) {
        roll_up_fleet(tx, MINUTE_MS, from, to).await?;
    }
    if gpus.len() + processes.len() > SERIES_HOURS_MARKED_PER_FLUSH {
        let mut hours: Vec<i64> = late.iter().map(|m| bucket_start(*m, HOUR_MS)).collect();
        hours.sort_unstable();
        hours.dedup();
        sqlx::query(
            "INSERT INTO rollup_pending (step_ms, bucket_ms) SELECT $1, UNNEST($2::int8[])",
        )
        .bind(HOUR_MS)
        .bind(&hours)
        .execute(&mut **tx)
        .await?;
        return Ok(());
    }
    let (gpu_series, gpu_hours): (Vec<i64>, Vec<i64>) = gpus.into_iter().unzip();
    let (process_series, process_hours): (Vec<i64>, Vec<i64>) = processes.into_iter().unzip();
    sqlx::query(
        "INSERT INTO hour_redo_series (hour_ms, process, series_id)
         SELECT hour_ms, false, series_id FROM UNNEST($1::int8[], $2::int8[]) AS v(series_id, hour_ms)
         UNION ALL
         SELECT hour_ms, true, series_id FROM UNNEST($3::int8[], $4::int8[]) AS v(series_id, hour_ms)",
    )
    .bind(gpu_series)
    .bind(gpu_hours)
    .bind(process_series)
    .bind(process_hours)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
